"""The personalized-PCA study in quick mode keeps its ordering, and its generator has the stated θ."""

from __future__ import annotations

import numpy as np

from benchmarks import perpca as study
from benchmarks import quick_figures


def test_generator_has_orthonormal_truth_and_theta_grows_with_the_angle():
    cfg = study.SynthConfig(n_clients=8)
    thetas = []
    for alpha in (0.0, 30.0, 90.0):
        data, u, vs, theta = study.synthetic_fleet(cfg, alpha, seed=1)
        assert len(data) == 8 and all(x.shape == (cfg.n, cfg.d) for x in data.values())
        for v in vs:
            w = np.hstack([u, v])
            np.testing.assert_allclose(w.T @ w, np.eye(cfg.r1 + cfg.r2), atol=1e-12)
        thetas.append(theta)
    assert abs(thetas[0]) < 1e-12  # α = 0: every client has the same local subspace, θ = 0
    assert 0 < thetas[1] < thetas[2] < 1


def test_quick_study_perpca_recovers_below_pooled_and_local_pca():
    out = study.main(quick_figures.QUICK_ARGV)
    quick_figures.assert_no_drift("perpca", quick_figures.perpca_figures(out))
    moderate = next(r for r in out["synth"] if r["alpha"] == 60.0)
    assert 0.1 < moderate["theta"] < 0.3
    err = moderate["decoupled"]
    assert err["PerPCA"] < 0.5
    assert err["PerPCA"] < 0.1 * err["Pooled PCA"]
    assert err["PerPCA"] < 0.1 * err["Local PCA"]
    assert moderate["combined"]["PerPCA"] < moderate["combined"]["Pooled PCA"]
    # The recorded global error falls over the rounds.
    assert moderate["curve"][-1] < 0.05 * moderate["curve"][0]
    # The vibration part runs and scores better than chance for every method.
    (vib,) = out["vib"]
    for scores in vib["auroc"].values():
        assert set(scores) == set(study.VIB_METHODS)
        assert all(0.5 < s <= 1.0 for s in scores.values())


def test_auroc_counts_pairs_and_ties():
    labels = np.array([True, True, False, False])
    assert study.auroc(np.array([3.0, 2.0, 1.0, 0.0]), labels) == 1.0
    assert study.auroc(np.array([0.0, 1.0, 2.0, 3.0]), labels) == 0.0
    assert study.auroc(np.ones(4), labels) == 0.5

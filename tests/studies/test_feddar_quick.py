"""The FedDAR §5.1 study in quick mode keeps its ordering, and its data are the paper's."""

from __future__ import annotations

import numpy as np

from benchmarks import feddar_synthetic as study
from benchmarks import quick_figures


def test_synthetic_fleet_is_the_papers_setup():
    cfg = study.StudyConfig(n_clients=40)
    clients, tests, truth = study.synthetic_fleet(cfg, samples=5, alpha=0.4, seed=3)
    b, w = truth["B"], truth["W"]
    np.testing.assert_allclose(b.T @ b, np.eye(cfg.k), atol=1e-12)  # Q factors of Gaussian matrices
    np.testing.assert_allclose(w.T @ w, np.eye(cfg.k), atol=1e-12)
    for name, data in clients.items():
        assert len(data.train) == 5 and len(tests[name]) == cfg.n_test
        clean = np.einsum("nd,dk,nk->n", data.train.x, b, w[data.train.domain])
        noise = data.train.y[:, 0] - clean
        assert 0 < np.abs(noise).max() < 6 * cfg.sigma  # σ = 1e-3 label noise on training data
        t = tests[name]
        np.testing.assert_allclose(t.y[:, 0], np.einsum("nd,dk,nk->n", t.x, b, w[t.domain]), atol=1e-12)
    # Dir(α·p) with α = 0.4 and M = 5: most clients are dominated by one domain.
    assert np.mean(truth["pi"].max(axis=1) > 0.8) > 0.4


def test_quick_study_orders_feddar_sa_far_below_the_baselines():
    out = study.main(quick_figures.QUICK_ARGV)
    quick_figures.assert_no_drift("feddar_synthetic", quick_figures.feddar_figures(out))
    finals = {r.job.method: r.final for r in out["results"]}
    assert set(finals) == {"Local-only", "FedAvg", "FedRep", "Separate FedAvg", "FedDAR-WA", "FedDAR-SA"}
    assert all(np.isfinite(v) for v in finals.values())
    sa = finals["FedDAR-SA"]
    assert sa < 1e-3
    assert finals["FedAvg"] >= 100 * sa
    assert finals["Local-only"] >= 100 * sa
    assert finals["FedRep"] >= 100 * sa
    # Identifiable here (each domain pools > d samples) but slower: ~10^3 x at 50 rounds, ~10^2 at 100.
    assert finals["Separate FedAvg"] >= 100 * sa
    # Learning curves come back for the plot and fall for FedDAR-SA.
    sa_run = next(r for r in out["results"] if r.job.method == "FedDAR-SA")
    assert sa_run.rounds[-1] == out["config"]["rounds"]
    assert sa_run.mse[-1] < 1e-2 * sa_run.mse[0]


def test_rare_domain_prior_puts_the_given_mass_on_the_last_domain():
    cfg = study.StudyConfig(rare=0.01)
    np.testing.assert_allclose(cfg.prior(), [0.2475, 0.2475, 0.2475, 0.2475, 0.01])
    np.testing.assert_allclose(study.StudyConfig().prior(), np.full(5, 0.2))

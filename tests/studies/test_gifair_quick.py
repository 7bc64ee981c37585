"""The GIFAIR-FL study in quick mode: the group-loss spread falls below FedAvg's at a similar mean loss."""

from __future__ import annotations

import numpy as np

from benchmarks import gifair as study
from benchmarks import quick_figures


def test_fleet_has_two_kinds_of_unequal_size_with_shifted_data():
    cfg = study.StudyConfig()
    clients, groups = study.fleet(cfg, seed=0)
    assert sorted(set(groups.values())) == ["A", "B"]
    assert sum(g == "A" for g in groups.values()) == 16 and sum(g == "B" for g in groups.values()) == 4
    mean_a = np.mean([clients[d].train.x.mean() for d, g in groups.items() if g == "A"])
    mean_b = np.mean([clients[d].train.x.mean() for d, g in groups.items() if g == "B"])
    assert mean_b - mean_a > 0.3  # covariate shift
    assert all(c.test is not None and len(c.test) == cfg.n for c in clients.values())


def test_quick_study_gifair_narrows_the_group_loss_spread():
    out = study.main(quick_figures.QUICK_ARGV)
    quick_figures.assert_no_drift("gifair", quick_figures.gifair_figures(out))
    by = {r["lam"]: r["scores"] for r in out["results"]}
    fedavg, fair = by[None], by[0.1]
    assert fedavg["L_B"] > fedavg["L_A"]  # the small, shifted group is served worse by FedAvg
    assert fair["spread"] < 0.6 * fedavg["spread"]
    assert fair["group_var"] < fedavg["group_var"]
    assert fair["mean"] < 1.15 * fedavg["mean"]  # about the same mean loss
    assert fair["mean"] >= fedavg["mean"] - 1e-9  # FedAvg minimises the mean: fairness costs a little

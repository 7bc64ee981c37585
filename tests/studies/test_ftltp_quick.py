"""The FTL-TP welding study, quick mode: every run completes, and collaboration beats training alone."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from benchmarks import ftltp_welding as study


def test_quick_study_fills_every_table_and_ftltp_beats_individual_learning():
    # One seed: the orderings below hold with room on it (FTL-TP 0.59 against IL 0.47, chance 0.29),
    # and the suite pays half the time.
    cfg = replace(study.quick_config(), seeds=(0,))
    groups = study.load_groups(cfg)
    results = study.run_study(cfg, groups)
    cells = study.collect(results)

    # Every method has a value for every one of the 14 target rows (M, S, T; both pairings)...
    rows = study.target_rows(groups, study.PAIRINGS)
    assert len(rows) == 14
    for m in study.METHODS:
        for lab, g, t in rows:
            vals = cells.get(("main", m, lab, g, t))
            assert vals and all(0.0 <= v <= 1.0 for v in vals), (m, lab, g, t)
    # ... and the unbalanced and client-fraction studies cover the M+S targets.
    for variant in ("unbalanced", "C=1/3", "C=2/3"):
        for lab, g, t in study.target_rows(groups, [("M", "S")]):
            assert cells.get((variant, "FTL-TP", lab, g, t)), (variant, g, t)

    # The ordering that holds on the simulated welds (the paper: +20.83 points over IL):
    # a federated model of both task groups beats clients that train alone, by a wide margin,
    # and is far above chance on the never-seen target.
    means = study.method_means(cells, groups)
    assert means["FTL-TP"] >= means["IL"] + 0.05, means
    chance = np.mean([1 / len(groups[g].classes) for _, g, _ in rows])
    assert means["FTL-TP"] >= chance + 0.2, (means, chance)

    body = study.report(cfg, groups, results, seconds=0.0)
    assert "+8.08" in body and "## Unbalanced clients" in body and "## Client fraction" in body

"""Quick mode of ``benchmarks.newcomer``: a printer that joins a trained simulated fleet (issue 16)."""

from __future__ import annotations

import numpy as np

from benchmarks import quick_figures
from benchmarks.newcomer import INDIV, METHODS, run_fleet, simulated_fleet, targets


def test_pflda_newcomer_is_not_worse_than_indiv_from_its_first_round() -> None:
    pflda = [m for m in METHODS if m[0] in ("PFL-DA", "PFL-DA (no cold start)")]
    losses: dict[str, list[np.ndarray]] = {}
    by_seed = {}
    for seed in quick_figures.NEWCOMER_SEEDS:
        curves, _ = run_fleet(simulated_fleet(seed), seed, rounds_before=20, rounds_after=2, methods=pflda)
        by_seed[seed] = curves
        for label, curve in curves.items():
            losses.setdefault(label, []).append(curve)
        # The cold-start ordering, per seed: the fitted encoder makes round 1 already good.
        assert curves["PFL-DA"][0] <= curves[INDIV][0], (seed, curves)
        # ... and better than the random start PFL-DA had before the cold start.
        assert curves["PFL-DA"][0] < curves["PFL-DA (no cold start)"][0], (seed, curves)
    quick_figures.assert_no_drift("newcomer", quick_figures.newcomer_figures(by_seed))
    lines = targets({k: np.stack(v) for k, v in losses.items()})
    assert any("no worse than indiv from round 1: **met**" in line for line in lines), lines

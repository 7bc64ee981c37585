"""Quick mode of ``benchmarks.newcomer``: a printer that joins a trained simulated fleet."""

from __future__ import annotations

import numpy as np

from benchmarks import quick_figures
from benchmarks.newcomer import (
    CANDIDATE,
    INDIV,
    LOPO_METHODS,
    LOPO_SPEEDS,
    METHODS,
    OWN,
    OWN_LOSS,
    TABLE5_HPARAMS,
    TWIN,
    hindsight,
    lopo_fleet,
    lopo_targets,
    run_fleet,
    served_targets,
    simulated_fleet,
    targets,
)


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


def test_lopo_fold_leaves_one_printer_out_and_scores_it_on_speed30() -> None:
    speeds = (10, 20, 30, 40, 50, 60)
    runs = {
        p: {s: (np.full((3, 1), p + s / 100), np.full((3, 1), s / 50)) for s in speeds} for p in range(1, 7)
    }
    fleet = lopo_fleet(runs, 4)
    assert sorted(fleet.established) == [f"printer{p}" for p in (1, 2, 3, 5, 6)]
    train = fleet.established["printer1"].train
    assert sorted(set(np.round(train.y[:, 0] * 50).astype(int))) == [10, 20, 40, 50, 60]
    assert set(np.round(fleet.established["printer1"].test.y[:, 0] * 50).astype(int)) == {30}
    new = fleet.newcomer
    assert sorted(set(np.round(new.train.y[:, 0] * 50).astype(int))) == list(LOPO_SPEEDS)
    assert set(np.round(new.test.y[:, 0] * 50).astype(int)) == {30}
    np.testing.assert_allclose(new.train.x[:, 0].min(), 4.1)  # printer 4's own rows


def test_the_served_newcomer_s_alone_is_alone_on_every_row_and_its_judged_twin_is_apart() -> None:
    """Where the judge picks alone, the newcomer serves the copy on every row (``edge.serving.alone``):
    the very *indiv* reference, bit for bit; the judge scored its twin on the older rows."""
    speeds = (10, 20, 30, 40, 50, 60)
    runs = {
        p: {s: (np.full((3, 1), p + s / 100), np.full((3, 1), s / 50)) for s in speeds} for p in range(1, 7)
    }
    pflda = [m for m in LOPO_METHODS if m[0] == "PFL-DA"]
    curves, _ = run_fleet(lopo_fleet(runs, 4), 0, 2, 3, pflda, TABLE5_HPARAMS, served=True)
    np.testing.assert_array_equal(curves[f"PFL-DA {CANDIDATE} alone"], curves[INDIV])
    assert not np.array_equal(curves[f"PFL-DA {CANDIDATE} {TWIN}"], curves[INDIV])
    # The own-rows rule serves, each round, the candidate with the least loss on the newcomer's rows.
    names = ("personal", "global", "alone")
    tested = np.stack([curves[f"PFL-DA {CANDIDATE} {k}"] for k in names])
    own = np.stack([curves[f"PFL-DA {OWN_LOSS} {k}"] for k in names])
    picked = np.take_along_axis(tested, own.argmin(axis=0)[None], axis=0)[0]
    np.testing.assert_array_equal(curves[f"PFL-DA {OWN}"], picked)


def test_lopo_targets_count_folds_against_alone() -> None:
    alone = np.array([[1.0] * 5] * 18)
    pflda = alone.copy()
    pflda[:2, 0] = 2.0  # two folds worse at round 1
    pflda[:, 4] = 0.5
    fedper = alone * 1.5
    lines = lopo_targets({"PFL-DA": pflda, "FedPer": fedper, "FedAvg": fedper, INDIV: alone})
    assert "- PFL-DA: newcomer ≤ alone at round 1 in **16 of 18** folds (met; needs 16)" in lines
    assert any(line.startswith("- FedPer") and "**0 of 18**" in line for line in lines)
    assert not any(line.startswith("- FedAvg") for line in lines)
    assert any("median ratio **0.50**" in line for line in lines)


def test_hindsight_is_the_best_candidate_per_fold_and_round_and_counts_the_served_choice() -> None:
    personal = np.array([[1.0, 4.0], [2.0, 2.0]])
    global_ = np.array([[3.0, 1.0], [5.0, 0.5]])
    alone_c = np.array([[0.5, 6.0], [2.5, 9.0]])
    served = np.array([[1.0, 1.0], [2.0, 9.0]])  # personal, global / personal, alone
    alone = np.array([[1.0, 1.0], [1.0, 1.0]])
    losses = {
        "PFL-DA served": served,
        "PFL-DA candidate personal": personal,
        "PFL-DA candidate global": global_,
        "PFL-DA candidate alone": alone_c,
        INDIV: alone,
    }
    choices = {"PFL-DA served choice": np.array([[0, 1], [3, 2]])}  # the third: round 0's personal, kept
    best, lines = hindsight(losses, choices)
    np.testing.assert_array_equal(best["PFL-DA best in hindsight"], [[0.5, 1.0], [2.0, 0.5]])
    assert lines == [
        "- PFL-DA served: of 4 fold-rounds it served this round's personal 1, global 1, alone 1, and an "
        "earlier round's model the gate kept in 1; the hindsight best in 2 of 4"
    ]
    targets = served_targets({**best, INDIV: alone}, rounds=(1, 2), suffix=" best in hindsight")
    assert targets[-1].startswith(
        "- PFL-DA best in hindsight: largest fold ratio to alone over all rounds 2.00"
    )
    assert "≤ alone in 1 of 2 folds" in targets[0]

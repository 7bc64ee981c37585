"""A streaming round's checkpoints against real processes: the aggregator SIGKILLed between a
checkpoint of its partial sum and the next one resumes to the uninterrupted run's final model."""

from __future__ import annotations

import sqlite3

import pytest

from benchmarks.reliability import CrashBench


@pytest.mark.broker
@pytest.mark.slow
def test_killed_aggregator_resumes_from_its_checkpointed_partial_sum(tmp_path):
    # checkpoint_every = 1: every upload after the first of a round lands on a checkpoint, so each
    # kill leaves a partial sum and one stored upload past it (the 3 devices answer 3 rounds).  Round 1
    # keeps its uploads whole (its weight cap needs its own median: cloud_aggregator.rounds.engine),
    # so the first kill falls in round 2 (the 5th upload stored), the second in the restarted run.
    bench = CrashBench(tmp_path, checkpoint_every=1)
    try:
        trial = bench.trial(0, 3, ["after_store_update:5", "after_store_update:3"])
    finally:
        bench.close()
    assert trial.ok, trial
    assert (trial.completed, trial.lost, trial.doubled) == (3, 0, 0)
    assert len(trial.injected) == 2
    log = (tmp_path / "crash0" / "aggregator.log").read_text()
    assert "partial sum of 1 uploads restored from the store" in log
    db = sqlite3.connect(tmp_path / "crash0" / "state" / "aggregator.sqlite")
    try:  # a saved round leaves no partial, no fold notes and no payload behind
        assert [
            db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("partials", "folded", "updates")
        ] == [
            0,
            0,
            0,
        ]
    finally:
        db.close()

"""A streaming round's checkpoints against real processes: the aggregator SIGKILLed between a
checkpoint of its partial sum and the next one resumes to the uninterrupted run's final model."""

from __future__ import annotations

import sqlite3

import pytest

from benchmarks.reliability import CrashBench


@pytest.mark.broker
@pytest.mark.slow
def test_killed_aggregator_resumes_from_its_checkpointed_partial_sum(tmp_path):
    # checkpoint_every = 1: each upload folded is checkpointed at once.  Round 1 keeps its uploads
    # whole (its weight cap needs its own median: cloud_aggregator.rounds.engine), so round 2 is the
    # first to fold.  The plan does not depend on how the uploads happen to be batched (two that
    # waited in the queue together are both stored before either is folded, so a kill on the
    # second stored left no checkpoint on a loaded machine, and no "partial sum" line):
    # 1. the 4th upload stored, round 2's first, dies unfolded: the restart reads it back from the
    #    store and folds it, which checkpoints it, before it reads any message;
    # 2. the restarted run's first upload stored (another device's: the first one's re-send is a
    #    replay) dies unfolded: a partial sum of one upload and one stored upload past it.
    bench = CrashBench(tmp_path, checkpoint_every=1)
    try:
        trial = bench.trial(0, 3, ["after_store_update:4", "after_store_update:1"])
    finally:
        bench.close()
    assert trial.ok, trial
    assert (trial.completed, trial.lost, trial.doubled) == (3, 0, 0)
    assert len(trial.injected) == 2
    log = (tmp_path / "crash0" / "aggregator.log").read_text()
    first, second, third = log.split("IOFT_FAULT: kill at")
    assert "restored from the store" not in first
    assert "round 2/train: 1 uploads restored from the store" in second and "partial sum" not in second
    assert "round 2/train: partial sum of 1 uploads restored from the store" in third
    assert "round 2/train: 1 uploads restored from the store" in third
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

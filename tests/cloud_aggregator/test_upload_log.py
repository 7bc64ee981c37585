"""Large uploads go to the upload log beside the store: read back after a restart in arrival
order, emptied once a checkpoint folds them all, removed when the round's record commits."""

from __future__ import annotations

import os

import numpy as np

from cloud_aggregator.rounds.types import RoundRecord
from cloud_aggregator.store.sqlite import SqliteStore
from cloud_aggregator.store.upload_log import MIN_BYTES

BIG, SMALL = bytes(range(256)) * (MIN_BYTES // 256 + 1), b"small upload"


def record(round_: int) -> RoundRecord:
    return RoundRecord("t", round_, "train", "completed", [], {}, {}, {}, "g1", 0.0, 1.0)


def test_large_uploads_survive_a_restart_and_leave_with_their_round(tmp_path):
    # Prepare: one large and one small upload of round 1, and a large one of round 2.
    store = SqliteStore(tmp_path / "a.sqlite")
    assert store.put_update("t", 1, "train", "d1", "g1", BIG)
    assert store.put_update("t", 1, "train", "d2", "g1", SMALL)
    assert not store.put_update("t", 1, "train", "d1", "g1", BIG[::-1])  # the first one stands
    assert store.put_update("t", 2, "train", "d1", "g2", BIG[1:])
    log = tmp_path / "uploads" / "t" / "1-train.log"
    assert log.stat().st_size == 2 * len(BIG)  # the refused duplicate's bytes: written, pointed at by no row
    store.close()  # a restart reads them back, in arrival order
    store = SqliteStore(tmp_path / "a.sqlite")
    assert store.stored_updates("t", 1, "train", "g1") == [("d1", BIG), ("d2", SMALL)]
    # A checkpoint folding every logged upload of the round empties its file; the round's record removes it.
    store.put_update("t", 1, "train", "d3", "g1", BIG)
    store.put_partial("t", 1, "train", "g1", b"sum", {"d1": (1, {}), "d3": (1, {})})
    assert store.stored_updates("t", 1, "train", "g1") == [("d2", SMALL)]
    assert log.stat().st_size == 0
    store.save(record(1), (2, 0), {"w": np.zeros(2, np.float32)}, {})
    assert not log.exists()
    assert store.stored_updates("t", 2, "train", "g2") == [("d1", BIG[1:])]  # the next round's stays
    store.close()


def test_a_lost_log_loses_only_its_uploads(tmp_path):
    store = SqliteStore(tmp_path / "a.sqlite")
    store.put_update("t", 1, "train", "d1", "g1", BIG)
    store.put_update("t", 1, "train", "d2", "g1", SMALL)
    store.close()
    (tmp_path / "uploads" / "t" / "1-train.log").write_bytes(b"")  # truncated behind the store's back
    store = SqliteStore(tmp_path / "a.sqlite")
    assert store.stored_updates("t", 1, "train", "g1") == [("d2", SMALL)]  # d1 re-sends on re-announcement
    store.close()


def test_a_batch_of_4kb_uploads_goes_to_the_log_in_one_write_and_reads_back_in_order(tmp_path, monkeypatch):
    # A batch of 4 kB uploads (1k float32 parameters: past a SQLite page) and a small one between them.
    uploads = [bytes([i]) * 4400 for i in range(5)]
    rows = [("t", 1, "train", f"d{i}", "g1", p) for i, p in enumerate(uploads)]
    rows.insert(2, ("t", 1, "train", "small", "g1", SMALL))
    writes: list[int] = []
    writev = os.writev

    def short_writev(fd, buffers):  # the kernel takes at most 5,000 bytes a call: short writes
        writes.append(len(buffers))
        return writev(fd, [memoryview(b"".join(bytes(b) for b in buffers))[:5000]])

    monkeypatch.setattr(os, "writev", short_writev)
    store = SqliteStore(tmp_path / "a.sqlite")
    store.put_batch(rows, [])
    store.close()
    assert writes[0] == len(uploads)  # every logged payload of the batch offered to one call
    log = tmp_path / "uploads" / "t" / "1-train.log"
    assert log.read_bytes() == b"".join(uploads)
    store = SqliteStore(tmp_path / "a.sqlite")
    assert store.stored_updates("t", 1, "train", "g1") == [(r[3], r[5]) for r in rows]
    store.close()

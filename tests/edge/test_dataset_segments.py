"""The dataset as append-only segments: cover rules, compaction, trimming, corruption, and SIGKILL
at random points of appends and merges (a real forked process, seeded kill times)."""

from __future__ import annotations

import os
import select
import shutil
import signal
import time

import numpy as np
import pytest

from edge import segment_writer, segments
from edge.dataset import load_dataset, save_dataset
from edge.recording.base import DatasetAppender
from edge.segments import SEGMENT_DIR, SegmentName, cover
from trainer_lite.data import Dataset

WIDTH = 64


@pytest.fixture
def compaction():
    """Set the appender's compaction knobs for one test; restored afterwards."""
    saved = DatasetAppender.fanout, DatasetAppender.seal_bytes

    def set_(fanout: int, seal_bytes: int = 1 << 30) -> None:
        DatasetAppender.fanout, DatasetAppender.seal_bytes = fanout, seal_bytes

    yield set_
    DatasetAppender.fanout, DatasetAppender.seal_bytes = saved


def appender(state, max_rows: int = 100_000) -> DatasetAppender:
    return DatasetAppender(
        state,
        source="test",
        x_dim=WIDTH,
        y_dtype=np.int64,
        y_1d=True,
        meta={"source": "test"},
        max_rows=max_rows,
    )


def split_of(i: int) -> str:
    return "test" if i % 4 == 3 else "train"


def add_rows(rec: DatasetAppender, first: int, n: int) -> int:
    """Rows ``first .. first+n-1`` (row i: every input i, label i); the next row's number."""
    for i in range(first, first + n):
        rec.add(split_of(i), np.full(WIDTH, float(i)), i)
    return first + n


def row_ids(state) -> tuple[list[int], list[int], dict]:
    train, test, meta = load_dataset(state)
    for d in (train, test):
        assert np.all(d.x == d.y[:, None]), "a row's inputs and label were torn apart"
    return train.y.tolist(), test.y.tolist(), meta


def expected(n: int, max_rows: int) -> tuple[list[int], list[int]]:
    ids = {"train": [], "test": []}
    for i in range(n):
        ids[split_of(i)].append(i)
    return ids["train"][-max_rows:], ids["test"][-max_rows:]


# -- the cover ---------------------------------------------------------------------------------------
def test_cover_prefers_merged_files_and_starts_at_the_newest_base():
    n = [SegmentName(a, b, k) for a, b, k in [(1, 1, "seg"), (2, 2, "seg"), (1, 2, "seg"), (3, 3, "seg")]]
    assert [x.name for x in cover(n)] == [
        "seg-00000001-00000002.safetensors",
        "seg-00000003-00000003.safetensors",
    ]
    n += [SegmentName(4, 4, "base"), SegmentName(5, 5, "seg")]
    assert [(x.first, x.kind) for x in cover(n)] == [(4, "base"), (5, "seg")]


# -- appends, compaction, trimming ---------------------------------------------------------------------
def test_appends_compact_into_few_files_and_every_row_loads_once(tmp_path, compaction):
    compaction(4)
    rec, i = appender(tmp_path), 0
    for _ in range(50):
        i = add_rows(rec, i, 1)
        assert rec.flush({"next": i})
    files = sorted(p.name for p in (tmp_path / SEGMENT_DIR).iterdir())
    assert len(files) <= 3 * 3 + 1  # a run below `fanout` per level, no temp files
    assert not (tmp_path / "dataset.safetensors").exists()
    train, test, meta = row_ids(tmp_path)
    assert (train, test) == expected(50, 10**9) and meta["next"] == 50
    assert meta["rows"] == {"train": len(train), "test": len(test)}


def test_max_rows_keeps_the_newest_rows_and_deletes_segments_it_emptied(tmp_path, compaction):
    compaction(3)
    rec, i = appender(tmp_path, max_rows=5), 0
    for _ in range(40):
        i = add_rows(rec, i, 2)
        assert rec.flush()
    assert (rec.rows("train"), rec.rows("test")) == (5, 5)
    train, test, _ = row_ids(tmp_path)
    assert (train, test) == expected(80, 5)
    stored = sum(
        len(segments.read_segment(p, SegmentName.parse(p.name))[1]["train_x"])
        for p in (tmp_path / SEGMENT_DIR).iterdir()
    )
    assert stored < 20  # trimmed rows do not pile up on disk


def test_a_failed_write_keeps_the_rows_for_the_next_flush(tmp_path, monkeypatch):
    rec = appender(tmp_path)
    add_rows(rec, 0, 3)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(segment_writer, "atomic_write_bytes", full)
    assert not rec.flush() and rec.pending == 3 and rec.write_errors == 1
    monkeypatch.undo()
    assert rec.flush() and rec.pending == 0
    assert row_ids(tmp_path)[:2] == expected(3, 10)


def test_replacing_the_dataset_voids_the_appended_segments(tmp_path):
    rec = appender(tmp_path)
    add_rows(rec, 0, 4)
    assert rec.flush()
    d = Dataset(np.zeros((2, WIDTH)), np.zeros(2, dtype=np.int64))
    save_dataset(tmp_path, d, d, {"source": "test", "replaced": True})
    train, test, meta = load_dataset(tmp_path)
    assert (len(train), len(test), meta["replaced"]) == (2, 2, True)
    assert [p.name for p in (tmp_path / SEGMENT_DIR).iterdir()] == ["base-00000002-00000002.safetensors"]


# -- what a kill or a bad sector leaves --------------------------------------------------------------
def test_parts_left_beside_their_merge_by_a_kill_are_not_read_twice(tmp_path, compaction):
    compaction(100)
    rec, i = appender(tmp_path), 0
    for _ in range(4):
        i = add_rows(rec, i, 2)
        assert rec.flush()
    folder = tmp_path / SEGMENT_DIR
    parts = tmp_path / "parts"
    shutil.copytree(folder, parts)
    rec.store.fanout = 4
    rec.store.tidy()
    for p in parts.iterdir():  # as if killed after the merged file's rename, before the deletes
        shutil.copy(p, folder / p.name)
    assert len(list(folder.iterdir())) == 5
    assert row_ids(tmp_path)[:2] == expected(8, 100)
    appender(tmp_path)  # a recorder starting here removes the leftovers
    assert [p.name for p in folder.iterdir()] == ["seg-00000001-00000004.safetensors"]


def test_a_corrupt_newest_segment_gives_the_dataset_before_its_append(tmp_path, caplog):
    rec = appender(tmp_path)
    for k in range(3):
        add_rows(rec, 2 * k, 2)
        assert rec.flush({"flush": k})
    newest = tmp_path / SEGMENT_DIR / "seg-00000003-00000003.safetensors"
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF
    newest.write_bytes(bytes(data))
    train, test, meta = row_ids(tmp_path)
    assert (train, test) == expected(4, 10) and meta["flush"] == 1  # what .prev gave the single file
    assert newest.with_name(newest.name + ".corrupt").exists()
    assert "is corrupt" in caplog.text
    rec2 = appender(tmp_path)  # and the recorder goes on from there, never reusing the number
    add_rows(rec2, 4, 1)
    assert rec2.flush()
    assert (tmp_path / SEGMENT_DIR / "seg-00000004-00000004.safetensors").exists()
    assert row_ids(tmp_path)[0] == [0, 1, 2, 4]


def test_a_segment_missing_an_array_counts_as_corrupt(tmp_path):
    from ioft_protocol.state import encode_arrays

    rec = appender(tmp_path)
    add_rows(rec, 0, 2)
    assert rec.flush()
    bad = tmp_path / SEGMENT_DIR / "seg-00000002-00000002.safetensors"
    meta = {
        "segment": {
            "seq": [2, 2],
            "level": 0,
            "ids": {"train": 2, "test": 0},
            "live_from": {"train": 0, "test": 0},
        }
    }
    bad.write_bytes(encode_arrays({"train_x": np.zeros((1, WIDTH))}, {**meta, "dataset": {"source": "test"}}))
    assert row_ids(tmp_path)[0] == [0, 1]
    assert bad.with_name(bad.name + ".corrupt").exists()


# -- SIGKILL at random points --------------------------------------------------------------------------
def _append_forever(state, ack_fd: int, seed: int, max_rows: int) -> None:
    """Child: append batches of 1-3 rows, writing the rows acknowledged so far to ``ack_fd``."""
    rng = np.random.default_rng(seed)
    rec = appender(state, max_rows=max_rows)
    nxt = int(rec.meta.get("next", 0))
    while True:
        nxt = add_rows(rec, nxt, int(rng.integers(1, 4)))
        if rec.flush({"next": nxt}):
            os.write(ack_fd, f"{nxt}\n".encode())


def _kill_trial(state, rng: np.random.Generator, seed: int, max_rows: int) -> int:
    """Fork an appender, SIGKILL it at a seeded random time; the rows it had acknowledged."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child appends until killed; it never returns into pytest
        try:
            os.close(r)
            _append_forever(state, w, seed, max_rows)
        finally:
            os._exit(1)
    os.close(w)
    buf = b""
    select.select([r], [], [], 30)  # the first acknowledgement: the child is past its start
    time.sleep(float(rng.uniform(0.0, 0.06)))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    while chunk := os.read(r, 65536):
        buf += chunk
    os.close(r)
    lines = buf.decode().split()
    return int(lines[-1]) if lines else 0


@pytest.mark.parametrize("max_rows", [100_000, 12], ids=["all-rows", "trimmed"])
def test_sigkill_during_appends_and_merges_keeps_every_acknowledged_row_once(tmp_path, compaction, max_rows):
    compaction(3, seal_bytes=40_000)  # merges every few appends, so that kills land in them too
    rng = np.random.default_rng(20260)
    acked_before = 0
    for trial in range(24):
        acked = _kill_trial(tmp_path, rng, trial, max_rows)
        train, test, meta = row_ids(tmp_path)
        n = int(meta["next"])
        assert n >= max(acked, acked_before), (trial, acked, n)  # nothing acknowledged was lost
        assert n <= max(acked, acked_before) + 3  # at most the batch in flight, whole
        assert (train, test) == expected(n, max_rows), trial  # each row once, in order
        acked_before = n
    leftovers = [p.name for p in (tmp_path / SEGMENT_DIR).iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) <= 1  # a recorder start removes those of earlier kills

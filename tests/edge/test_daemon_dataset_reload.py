"""The daemon picks up rows that edge-recorder appends while it runs (no broker needed)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from edge import folder_listing, segments
from edge.config import DeviceConfig
from edge.daemon import EdgeTrainer
from edge.dataset import FILE, load_dataset, save_dataset
from edge.recording.base import DatasetAppender
from edge.segments import DatasetReader
from ioft_protocol.config import build
from ioft_protocol.state import save_arrays
from trainer_lite.data import Dataset


def rows(n: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset(rng.normal(size=(n, 1)).astype(np.float32), rng.normal(size=(n, 1)).astype(np.float32))


def test_daemon_starts_without_data_and_reloads_each_new_dataset(tmp_path):
    state = tmp_path / "printer3"
    cfg = build(
        DeviceConfig,
        {"device": "printer3", "fleet": "plant", "state_dir": str(state), "allow_plaintext": True},
    )
    assert cfg.data.source == "state"
    trainer = EdgeTrainer(cfg)  # not started: no broker needed
    assert len(trainer.train) == 0 and not trainer.refresh_dataset()
    save_dataset(state, rows(5, 0), rows(2, 1), {"source": "edge-recorder"})
    assert trainer.refresh_dataset()
    assert (len(trainer.train), len(trainer.test)) == (5, 2)
    assert not trainer.refresh_dataset()  # unchanged file: no reload
    save_dataset(state, rows(9, 2), rows(3, 3), {"source": "edge-recorder"})
    assert trainer.refresh_dataset()
    assert (len(trainer.train), len(trainer.test)) == (9, 3)
    np.testing.assert_array_equal(trainer.train.x, rows(9, 2).x)
    # A replacement within the same clock tick is a new base segment: seen by its name.
    save_dataset(state, rows(9, 4), rows(3, 5), {"source": "edge-recorder"})
    assert trainer.refresh_dataset()
    np.testing.assert_array_equal(trainer.train.x, rows(9, 4).x)


def appender(state, *, fanout: int = 4) -> DatasetAppender:
    DatasetAppender.fanout, DatasetAppender.seal_bytes = fanout, 1 << 30  # restored by the fixture
    return DatasetAppender(
        state,
        source="record-printer",
        x_dim=2,
        y_dtype=np.float64,
        y_1d=False,
        meta={"source": "record-printer"},
    )


@pytest.fixture
def small_segments():
    saved = DatasetAppender.fanout, DatasetAppender.seal_bytes
    yield
    DatasetAppender.fanout, DatasetAppender.seal_bytes = saved


def test_the_trainer_reads_only_new_segments_and_keeps_its_rows_across_compaction(
    tmp_path, monkeypatch, small_segments
):
    """Prepare: a recorder appends while the trainer runs. Execute: refresh after each append.
    Assert: each refresh reads only the new segment; a merge of segments it holds reads nothing."""
    state = tmp_path / "printer3"
    cfg = build(
        DeviceConfig,
        {"device": "printer3", "fleet": "plant", "state_dir": str(state), "allow_plaintext": True},
    )
    trainer = EdgeTrainer(cfg)
    reads = []
    original = segments.read_segment
    monkeypatch.setattr(
        segments, "read_segment", lambda path, name: reads.append(name.name) or original(path, name)
    )
    rec = appender(state)
    for i in range(10):
        rec.add("test" if i % 3 == 2 else "train", [i, -i], [float(i)])
        assert rec.flush({"n": i})
        reads.clear()
        assert trainer.refresh_dataset()
        # One file per refresh: the new segment, or the merge that took it in with segments held.
        assert len(reads) == 1 and reads[0].endswith(f"-{i + 1:08d}.safetensors"), reads
        assert trainer.data_meta["n"] == i
    assert trainer.train.x[:, 0].tolist() == [0, 1, 3, 4, 6, 7, 9]
    assert trainer.test.x[:, 0].tolist() == [2, 5, 8]
    rec.store.fanout = 2
    rec.store.tidy()  # merges everything the trainer holds into one file
    assert [p.name for p in (state / "dataset.segments").iterdir()] == ["seg-00000001-00000010.safetensors"]
    reads.clear()
    assert not trainer.refresh_dataset() and reads == []  # nothing new: its arrays are kept
    fresh, _, _ = load_dataset(state)
    np.testing.assert_array_equal(fresh.x, trainer.train.x)


def test_a_dataset_of_the_old_single_file_loads_and_takes_appends(tmp_path, small_segments):
    state = tmp_path / "printer3"
    old_train = Dataset(np.arange(6.0).reshape(3, 2), np.ones((3, 1)))
    old_test = Dataset(np.full((1, 2), 9.0), np.ones((1, 1)))
    arrays = {"train_x": old_train.x, "train_y": old_train.y, "test_x": old_test.x, "test_y": old_test.y}
    save_arrays(state / FILE, arrays, {"source": "record-printer", "runs": 2})
    reader = DatasetReader(state)
    train, test, meta = reader.load()
    assert (len(train), len(test), meta["runs"]) == (3, 1, 2)
    rec = appender(state)
    rec.add("train", [7.0, 7.0], [0.5])
    assert rec.flush({"runs": 3})
    assert (state / FILE).exists()  # read as is, never rewritten
    assert reader.refresh()
    assert reader.train.x[:, 0].tolist() == [0.0, 2.0, 4.0, 7.0] and reader.meta["runs"] == 3
    train, test, _ = load_dataset(state)
    assert len(train) == 4 and len(test) == 1


def test_the_device_status_reports_its_rows_and_the_recorders_sensor_state(tmp_path):
    import json

    state = tmp_path / "printer3"
    cfg = build(
        DeviceConfig,
        {"device": "printer3", "fleet": "plant", "state_dir": str(state), "allow_plaintext": True},
    )
    trainer = EdgeTrainer(cfg)
    body = json.loads(trainer.link.status("online")[1])
    # "schema": the feature schema a model push picks its devices by; none without a dataset.
    assert body["data"] == {"train": 0, "test": 0, "source": None, "schema": None}
    save_dataset(state, rows(5, 0), rows(2, 1), {"source": "record-printer"})
    (state / "recorder-status.json").write_text(
        json.dumps(
            {"state": "fault", "running": True, "updated_at": "2026-11-24T21:00:00+00:00", "appended": 7}
        )
    )
    trainer.refresh_dataset()
    body = json.loads(trainer.link.status("online")[1])
    assert body["data"]["train"] == 5 and body["data"]["source"] == "record-printer"
    assert body["data"]["sensor"]["state"] == "fault" and body["data"]["sensor"]["appended"] == 7
    (state / "recorder-status.json").write_text("{not json")
    assert "sensor" not in json.loads(trainer.link.status("online")[1])["data"]


def test_an_unchanged_settled_folder_is_not_listed_again_but_a_change_in_the_same_tick_is_seen(
    tmp_path, monkeypatch, small_segments
):
    """A refresh per round per device: the segment folder is listed again only when its mtime
    changed, and a listing made while that mtime was recent is not trusted (a second change within
    the filesystem's timestamp tick keeps the mtime)."""
    state = tmp_path / "printer3"
    rec = appender(state)
    rec.add("train", [1.0, -1.0], [1.0])
    assert rec.flush({"n": 1})
    folder = state / segments.SEGMENT_DIR
    settled = folder.stat().st_mtime_ns - 5 * folder_listing.RACY_NS  # set back: as if written long ago
    os.utime(folder, ns=(settled, settled))
    reader = DatasetReader(state)
    reader.load()
    listings = []
    original = segments.list_names
    monkeypatch.setattr(segments, "list_names", lambda f: listings.append(f) or original(f))
    for _ in range(3):
        assert not reader.refresh()
    assert listings == []  # read once by load(), then trusted: its mtime has not changed
    # An append changes the folder's mtime: listed and read.
    rec.add("train", [2.0, -2.0], [2.0])
    assert rec.flush({"n": 2})
    assert reader.refresh() and reader.meta["n"] == 2 and len(listings) == 1
    # The next append lands in the same timestamp tick (its mtime set to what the listing saw):
    # the listing above was made while the mtime was recent, so it is not trusted.
    seen = folder.stat().st_mtime_ns
    rec.add("train", [3.0, -3.0], [3.0])
    assert rec.flush({"n": 3})
    os.utime(folder, ns=(seen, seen))
    assert reader.refresh() and reader.meta["n"] == 3
    assert reader.train.x[:, 0].tolist() == [1.0, 2.0, 3.0]

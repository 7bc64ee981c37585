"""The daemon picks up rows that edge-recorder appends while it runs (no broker needed)."""

from __future__ import annotations

import os

import numpy as np

from edge.config import DeviceConfig
from edge.daemon import EdgeTrainer
from edge.dataset import save_dataset
from ioft_protocol.config import build
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
    # A file replaced within the same clock tick still differs by inode (atomic rename).
    before = (state / "dataset.safetensors").stat()
    save_dataset(state, rows(9, 4), rows(3, 5), {"source": "edge-recorder"})
    os.utime(state / "dataset.safetensors", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert trainer.refresh_dataset()
    np.testing.assert_array_equal(trainer.train.x, rows(9, 4).x)


def test_the_device_status_reports_its_rows_and_the_recorders_sensor_state(tmp_path):
    import json

    state = tmp_path / "printer3"
    cfg = build(
        DeviceConfig,
        {"device": "printer3", "fleet": "plant", "state_dir": str(state), "allow_plaintext": True},
    )
    trainer = EdgeTrainer(cfg)
    body = json.loads(trainer._status("online")[1])
    assert body["data"] == {"train": 0, "test": 0, "source": None}
    save_dataset(state, rows(5, 0), rows(2, 1), {"source": "record-printer"})
    (state / "recorder-status.json").write_text(
        json.dumps(
            {"state": "fault", "running": True, "updated_at": "2026-11-24T21:00:00+00:00", "appended": 7}
        )
    )
    trainer.refresh_dataset()
    body = json.loads(trainer._status("online")[1])
    assert body["data"]["train"] == 5 and body["data"]["source"] == "record-printer"
    assert body["data"]["sensor"]["state"] == "fault" and body["data"]["sensor"]["appended"] == 7
    (state / "recorder-status.json").write_text("{not json")
    assert "sensor" not in json.loads(trainer._status("online")[1])["data"]

"""The device's per-round path at swarm scale (no broker): an announcement is decoded once for
all the devices sharing an ``Announcements``, and the status after a round goes out at most every
``round_status_s`` (at once when the task is done)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge.announcements import Announcements
from edge.config import DeviceConfig
from edge.daemon import EdgeTrainer
from edge.dataset import save_dataset
from ioft_protocol import round_messages, topics
from ioft_protocol.config import build
from trainer_lite.data import Dataset
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

SPEC = TaskSpec(name="bench", algorithm="echo", model="vector", rounds=5, model_args={"size": 16})


def device(tmp_path, name: str, announcements: Announcements | None = None, **extra) -> EdgeTrainer:
    state = tmp_path / name
    rng = np.random.default_rng(0)
    rows = Dataset(rng.normal(size=(6, 1)).astype(np.float32), rng.normal(size=(6, 1)).astype(np.float32))
    save_dataset(state, rows, rows, {"source": "edge-recorder"})
    cfg = build(
        DeviceConfig,
        {"device": name, "fleet": "plant", "state_dir": str(state), "allow_plaintext": True, **extra},
    )
    trainer = EdgeTrainer(cfg, announcements=announcements)  # not started: no broker needed
    trainer.sent = []
    trainer.session.publish = lambda topic, payload, **kw: trainer.sent.append((topic, payload))
    return trainer


def announcement(round_: int, state: str = "running") -> tuple[str, bytes]:
    params = {"v.value": np.full(16, float(round_), np.float32)}
    ann = round_messages.Announcement(
        "plant", "bench", round_, "train", SPEC.to_json(), 0.0, param_hash(params), state=state, params=params
    )
    return topics.topic_down("plant", "bench"), ann.encode()


def statuses(trainer: EdgeTrainer) -> list[dict]:
    mine = topics.topic_status("plant", trainer.device)
    return [json.loads(p) for t, p in trainer.sent if t == mine]


def test_devices_sharing_announcements_decode_each_once(tmp_path):
    shared = Announcements()
    a, b = device(tmp_path, "p1", shared), device(tmp_path, "p2", shared)
    topic, payload = announcement(1)
    a.handle(topic, payload)
    b.handle(topic, bytes(payload))  # another copy of the same bytes, as each connection gets one
    assert a._last_ann["bench"] is b._last_ann["bench"]  # one decode
    assert not a._last_ann["bench"].params["v.value"].flags.writeable  # shared: nobody may change it
    assert a.tasks["bench"].answered == b.tasks["bench"].answered == (1, "train")
    assert [t for t, _ in a.sent].count(topics.topic_up("plant", "bench", "p1")) == 1
    # Other bytes on the topic (the next round) are decoded afresh.
    a.handle(*announcement(2))
    assert a._last_ann["bench"] is not b._last_ann["bench"] and a.tasks["bench"].answered == (2, "train")


def test_round_status_goes_out_at_most_every_round_status_s(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("edge.daemon.time.monotonic", lambda: clock[0])
    t = device(tmp_path, "p1", round_status_s=30)
    t.handle(*announcement(1))
    assert [s["tasks"]["bench"]["round"] for s in statuses(t)] == [1]  # the first one at once
    clock[0] += 5
    t.handle(*announcement(2))
    t.tick()
    assert len(statuses(t)) == 1  # within 30 s: waits
    clock[0] += 26
    t.tick()
    assert [s["tasks"]["bench"]["round"] for s in statuses(t)] == [1, 2]  # from tick, once due
    clock[0] += 1
    t.handle(*announcement(3))
    t.handle(*announcement(3, state="done"))  # the task ends: its last round shows at once
    assert [s["tasks"]["bench"]["round"] for s in statuses(t)] == [1, 2, 3]


def test_round_status_s_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="round_status_s"):
        build(DeviceConfig, {"device": "p1", "round_status_s": -1})


def test_a_connected_device_republishes_its_status_every_heartbeat_s(tmp_path, monkeypatch):
    """Issue 32 §5: the aggregator waits only for devices heard live lately; a quiet device's
    heartbeat is its status again, once ``heartbeat_s`` passed without one (any status, the one
    published on connect too, resets it), only while connected."""
    clock = [1000.0]
    monkeypatch.setattr("edge.daemon.time.monotonic", lambda: clock[0])
    t = device(tmp_path, "p1", heartbeat_s=30, aggregator_quiet_s=1e9)  # no "unheard" status
    t.tick()
    assert statuses(t) == []  # not connected: nothing to say it on
    t.session.connected.set()
    t.link.birth()  # the status every connect publishes counts as the first heartbeat
    clock[0] += 29
    t.tick()
    assert statuses(t) == []
    clock[0] += 1
    t.tick()
    assert [s["state"] for s in statuses(t)] == ["online"]
    clock[0] += 29
    t.tick()
    assert len(statuses(t)) == 1
    clock[0] += 1
    t.tick()
    assert len(statuses(t)) == 2  # one a period, while nothing else is said
    off = device(tmp_path, "p2", heartbeat_s=0)
    off.session.connected.set()
    clock[0] += 3600
    off.tick()
    assert statuses(off) == []  # 0: no heartbeat


def test_heartbeat_s_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="heartbeat_s"):
        build(DeviceConfig, {"device": "p1", "heartbeat_s": -1})

"""A task spec carries the feature-schema hash its model is built for; a device whose
data has another schema (or none) refuses the task, logs why once and sends nothing."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from edge.config import DeviceConfig
from edge.daemon import EdgeTrainer
from ioft_protocol import round_messages, topics
from ioft_protocol.config import build
from sensors.sim.vibration import WINDOW_SCHEMA
from trainer_lite.algorithms import make_client
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

OTHER_SCHEMA = "ab" * 32  # a well-formed hash of some other schema


def spec(name: str, feature_schema: str | None) -> TaskSpec:
    width = WINDOW_SCHEMA.shape[0] * WINDOW_SCHEMA.shape[1]
    return TaskSpec(
        name=name,
        algorithm="fedavg",
        model="mlp",
        model_args={"sizes": [width, 4, 1]},
        hparams={"local_steps": 1},
        feature_schema=feature_schema,
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    state = tmp_path_factory.mktemp("printer4")
    cfg = build(
        DeviceConfig,
        {
            "device": "printer4",
            "fleet": "plant",
            "state_dir": str(state),
            "allow_plaintext": True,
            "data": {"source": "simulate-printer-raw"},
        },
    )
    t = EdgeTrainer(cfg)  # not started: no broker needed
    assert t.data_meta["schema_hash"] == WINDOW_SCHEMA.schema_hash()
    return t


def announce(trainer: EdgeTrainer, s: TaskSpec, round_: int = 1) -> list[tuple[str, bytes]]:
    sent: list[tuple[str, bytes]] = []
    trainer.session.publish = lambda topic, payload, **kw: sent.append((topic, payload))
    shared = make_client(s).init_global(np.random.default_rng(0))  # built without the device
    ann = round_messages.Announcement(
        "plant", s.name, round_, "train", s.to_json(), 0.0, param_hash(shared), params=shared
    )
    trainer.handle(f"{topics.PROTOCOL}/plant/task/{s.name}/down", ann.encode())
    return sent


def test_spec_json_round_trips_and_leaves_the_field_out_when_unset():
    with_hash = spec("weld", OTHER_SCHEMA)
    assert TaskSpec.from_json(with_hash.to_json()) == with_hash
    plain = spec("speed", None)
    assert "feature_schema" not in json.loads(plain.to_json())  # older specs serialize as before
    assert TaskSpec.from_json(plain.to_json()) == plain
    for bad in ("", "abc", "AB" * 32, 5):
        with pytest.raises(ValueError, match="feature_schema"):
            spec("weld", bad)


def test_a_task_for_the_local_schema_trains(trainer):
    sent = announce(trainer, spec("same", WINDOW_SCHEMA.schema_hash()))
    assert trainer.tasks["same"].answered == (1, "train")
    assert topics.topic_up("plant", "same", "printer4") in [topic for topic, _ in sent]
    assert "same" not in trainer.refused


def test_a_task_without_a_schema_trains_as_before(trainer):
    announce(trainer, spec("unchecked", None))
    assert trainer.tasks["unchecked"].answered == (1, "train")


def test_a_task_for_another_schema_is_refused_logged_once_and_reported(trainer, caplog):
    s = spec("other", OTHER_SCHEMA)
    with caplog.at_level(logging.WARNING, logger="edge.daemon"):
        first = announce(trainer, s, 1)
        second = announce(trainer, s, 2)
    assert "other" not in trainer.tasks  # no state, no training
    uploads = [topic for topic, _ in first + second if "/up" in topic]
    assert uploads == []  # nothing sent for it
    refusals = [r.getMessage() for r in caplog.records if "refusing task other" in r.getMessage()]
    assert len(refusals) == 1  # once, not every round
    msg = refusals[0]
    assert OTHER_SCHEMA[:12] in msg and WINDOW_SCHEMA.schema_hash()[:12] in msg
    status = json.loads(trainer.link.status("online")[1])
    assert "feature schema" in status["refused"]["other"]
    assert [json.loads(p)["refused"]["other"] for _, p in first] == [status["refused"]["other"]]


def test_data_without_a_schema_refuses_a_task_that_names_one(trainer, monkeypatch):
    monkeypatch.setitem(trainer.data_meta, "schema_hash", None)
    announce(trainer, spec("needs", WINDOW_SCHEMA.schema_hash()))
    assert "needs" not in trainer.tasks
    assert "no feature schema" in trainer.refused["needs"]


def test_a_known_task_is_refused_once_the_recorder_swaps_in_rows_of_another_schema(tmp_path):
    from edge.dataset import save_dataset
    from trainer_lite.data import Dataset

    state = tmp_path / "printer5"
    cfg = build(
        DeviceConfig,
        {"device": "printer5", "fleet": "plant", "state_dir": str(state), "allow_plaintext": True},
    )
    width = WINDOW_SCHEMA.shape[0] * WINDOW_SCHEMA.shape[1]
    rng = np.random.default_rng(0)

    def rows(n: int) -> Dataset:
        return Dataset(
            rng.normal(size=(n, width)).astype(np.float32), rng.normal(size=(n, 1)).astype(np.float32)
        )

    save_dataset(
        state, rows(8), rows(2), {"source": "record-printer", "schema_hash": WINDOW_SCHEMA.schema_hash()}
    )
    trainer = EdgeTrainer(cfg)
    s = spec("vib", WINDOW_SCHEMA.schema_hash())
    announce(trainer, s, 1)
    assert trainer.tasks["vib"].answered == (1, "train")  # its client is now cached
    save_dataset(state, rows(8), rows(2), {"source": "record-printer", "schema_hash": OTHER_SCHEMA})
    assert trainer.refresh_dataset()
    sent = announce(trainer, s, 2)
    assert trainer.tasks["vib"].answered == (1, "train")  # round 2 not trained
    assert [topic for topic, _ in sent if "/up" in topic] == []
    assert OTHER_SCHEMA[:12] in trainer.refused["vib"]

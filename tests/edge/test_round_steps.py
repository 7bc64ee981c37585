"""A round on the device in named steps (``edge.round_steps``): each check refuses one way,
with :class:`TaskRefused`, and a round whose downlink is malformed is dropped inside the round
(logged, nothing sent) instead of raising to whichever caller answered it."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from edge.round_steps import Clients, TaskRefused, check_selected, check_width
from ioft_protocol import round_messages, topics
from tests.edge.test_daemon_hot_path import SPEC, device
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec


def test_an_announcement_whose_params_miss_their_hash_is_dropped_inside_the_round(tmp_path, caplog):
    t = device(tmp_path, "p1")
    params = {"v.value": np.full(16, 1.0, np.float32)}
    tampered = round_messages.Announcement(
        "plant",
        "bench",
        1,
        "train",
        SPEC.to_json(),
        0.0,
        param_hash(params),
        params=params,
        params_hash="0" * 64,
    )
    with caplog.at_level(logging.WARNING):
        t.on_announcement(tampered)  # the pacer and the resume path call this too: it must not raise
    assert t.tasks["bench"].answered is None
    assert topics.topic_up("plant", "bench", "p1") not in [topic for topic, _ in t.sent]
    assert "do not match their announced hash" in caplog.text


def test_each_check_refuses_with_task_refused():
    mlp = TaskSpec(name="t", algorithm="fedavg", model="mlp", model_args={"sizes": [3, 4, 1]})
    rows = Dataset(np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32))
    with pytest.raises(TaskRefused, match="takes 3 input features per row"):
        check_width(make_client(mlp), (rows, rows, None), {"source": "test"})
    check_width(make_client(mlp), None, {})  # nothing to judge yet: no refusal
    selected = round_messages.DeviceSelection(kind="welder")
    ann = round_messages.Announcement("f", "t", 1, "train", mlp.to_json(), 0.0, "", devices=selected)
    with pytest.raises(TaskRefused, match="runs on kind 'welder'"):
        check_selected(ann, "p1", "printer", [])
    with pytest.raises(TaskRefused, match="not allowed on this device"):
        Clients(["fedprox"]).client(mlp.to_json(), {})
    with pytest.raises(TaskRefused, match="feature schema"):
        Clients().client(replace(mlp, feature_schema="ab" * 32).to_json(), {})

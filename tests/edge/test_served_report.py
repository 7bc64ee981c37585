"""What a device serves, in its round report (``Server.served_metrics``), and ``[serve] hold_out_always``:
a device that judges and serves before (or without) a recorder feeding it rows (``make demo``'s printers).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from edge.config import DataConfig, DeviceConfig, ServeConfig
from edge.serving.alone import alone_path
from edge.serving.server import Server
from tests.edge.test_candidates import line
from tests.edge.test_candidates_alone import drifted, offer
from tests.edge.test_serving import server
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

#: A FedDAR task: its models answer with each row's domain head.
FEDDAR = {"name": "feddar", "algorithm": "feddar", "model": "linear_rep", "model_args": {"d_in": 3, "k": 2},
          "hparams": {"n_domains": 2, "optimizer": "sgd", "lr": 0.05, "aggregation": "sa", "head_steps": 5},
          "dtype": "float64", "rounds": 3, "seed": 7}  # fmt: skip


def test_the_round_report_names_the_served_candidate_and_gives_its_test_loss(tmp_path):
    srv = server(tmp_path)
    test = line(12, seed=5)
    assert srv.served_metrics("speed", test) == {}  # nothing serves yet
    assert offer(srv, 1)  # the personal model is far off the line: alone serves
    got = srv.served_metrics("speed", test)
    assert got["served_round"] == 1.0
    assert {k: v for k, v in got.items() if k.startswith("serves_")} == {
        "serves_personal": 0.0,
        "serves_global": 0.0,
        "serves_alone": 1.0,
    }
    model = srv.models["speed"]
    assert model.candidate == "alone"
    # The task's own loss of the model that serves, on the test split as stored: the alone copy's
    # (an MSE of a line it fits), not the personal model's (w = -1 against the line's 2).
    pred = model.outputs(test.x)[:, 0]
    assert got["served_test_loss"] == pytest.approx(float(np.mean((pred - test.y[:, 0]) ** 2)), rel=1e-5)
    personal = dataclasses.replace(model, shared={}, local={}, candidate="personal", _digest=None)
    personal.local = {"fc0.weight": np.array([[-1.0]], np.float32), "fc0.bias": np.array([0.0], np.float32)}
    assert got["served_test_loss"] < personal.evaluate(test)["loss"] / 10
    # A test split of no rows: the candidate is still reported, with no loss.
    assert srv.served_metrics("speed", Dataset(np.zeros((0, 1)), np.zeros((0, 1)))) == {
        "serves_personal": 0.0,
        "serves_global": 0.0,
        "serves_alone": 1.0,
        "served_round": 1.0,
    }
    assert srv.served_metrics("other-task", test) == {}


def simulated(tmp_path, hold_out_always: bool) -> Server:
    config = DeviceConfig(
        device="p1",
        state_dir=str(tmp_path),
        data=DataConfig(source="simulate-printer"),
        serve=ServeConfig(hold_out_always=hold_out_always),
    )
    return Server(config, tmp_path, lambda topic, payload: None)


def test_a_simulated_device_serves_and_holds_out_only_when_told_to(tmp_path):
    quiet = simulated(tmp_path / "a", hold_out_always=False)
    assert not quiet.serves("speed") and not quiet.answering("speed")
    assert not offer(quiet, 1)  # no rows to answer: it trains on every row and serves nothing
    judging = simulated(tmp_path / "b", hold_out_always=True)
    assert judging.serves("speed") and judging.answering("speed")  # no feed, yet its rounds hold out
    assert offer(judging, 1)
    assert judging.served_metrics("speed", drifted())["serves_alone"] == 1.0


def test_hold_out_always_on_a_recording_device_holds_out_before_the_first_fed_row(tmp_path):
    assert not server(tmp_path / "a").answering("speed")  # default: from the first fed row
    assert server(tmp_path / "b", hold_out_always=True).answering("speed")


def test_a_task_whose_models_need_each_rows_domain_is_not_judged_and_says_why(tmp_path):
    """FedDAR answers with each row's domain head, which a row to answer does not carry: its rounds are
    offered, nothing is built or judged for it (no alone model), and the status says why."""
    algo = make_client(TaskSpec.from_json(json.dumps(FEDDAR)))
    srv = server(tmp_path)
    d_in = FEDDAR["model_args"]["d_in"]
    rows = Dataset(np.zeros((20, d_in)), np.zeros((20, 1)), np.zeros(20, dtype=int))
    shared = algo.init_global(np.random.default_rng(0))
    assert not srv.offer("feddar", algo, shared, {}, (rows, rows, None), (rows, rows, {}), 1)
    assert "answers with each row's domain" in srv.status()["gate"]["feddar"]
    assert not alone_path(tmp_path, "feddar").exists()
    assert srv.served_metrics("feddar", rows) == {}

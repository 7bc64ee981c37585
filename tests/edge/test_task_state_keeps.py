"""A device keeps a task's personal state when the operator only extends the task's rounds
(the aggregator keeps its history then too), and starts it afresh when the training changes."""

from __future__ import annotations

import numpy as np

from edge.config import DeviceConfig
from edge.daemon import EdgeTrainer
from ioft_protocol.config import build
from trainer_lite.algorithms import make_client
from trainer_lite.task import TaskSpec, training_changes


def _trainer(tmp_path) -> EdgeTrainer:
    cfg = build(
        DeviceConfig,
        {"device": "printer3", "state_dir": str(tmp_path), "allow_plaintext": True,
         "data": {"source": "simulate-printer"}},
    )  # fmt: skip
    return EdgeTrainer(cfg)  # not started: no broker needed


def test_more_rounds_keep_the_local_state_other_changes_reset_it(tmp_path):
    trainer = _trainer(tmp_path)
    spec = TaskSpec("speed", "pflda", "sigmoid_glm", hparams={"lam": 0.9}, rounds=5)
    algo = make_client(spec)
    state = trainer.states.get("speed", spec.to_json(), algo)
    trained = {k: v + 1.0 for k, v in state.local.items()}  # as after some rounds of training
    state.local = trained
    more = TaskSpec("speed", "pflda", "sigmoid_glm", hparams={"lam": 0.9}, rounds=50)
    kept = trainer.states.get("speed", more.to_json(), make_client(more))
    assert kept.spec_json == more.to_json()
    assert all(np.array_equal(kept.local[k], trained[k]) for k in trained)
    other = TaskSpec("speed", "pflda", "sigmoid_glm", hparams={"lam": 0.5}, rounds=50)
    reset = trainer.states.get("speed", other.to_json(), make_client(other))
    assert not all(np.array_equal(reset.local[k], trained[k]) for k in trained)


def test_training_changes_names_fields_but_not_the_schedule():
    a = TaskSpec("speed", "pflda", "sigmoid_glm", rounds=5).to_json()
    assert training_changes(a, TaskSpec("speed", "pflda", "sigmoid_glm", rounds=9).to_json()) == []
    assert training_changes(a, TaskSpec("speed", "fedavg", "linear", rounds=9).to_json()) == [
        "algorithm",
        "model",
    ]

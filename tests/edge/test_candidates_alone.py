"""The alone candidate's two copies (``edge.serving.alone``): judged on the older rows, served on every row.

Each test drives :meth:`Server.offer` as the daemon does, with rows stored oldest first: the newest
ones judge.  The machine has drifted by its newest rows, so a model that saw them answers them better.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

from edge.serving import gate
from edge.serving.alone import EVERY, alone_path, alone_spec, train_alone
from edge.serving.model import ServingModel
from ioft_protocol.state import load_arrays
from tests.edge.test_candidates import FAST, line
from tests.edge.test_serving import linear, server
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.base import algorithm_state
from trainer_lite.client import initial_local, participate
from trainer_lite.data import Dataset, holdout_size, newest_split
from trainer_lite.task import TaskSpec

N = 30
OLDER = N - holdout_size(N)


def drifted() -> Dataset:
    """``y = 2x + 0.5``, and 0.3 (15 mm/s) higher on the newest rows: the machine has drifted."""
    data = line(N)
    y = data.y.copy()
    y[OLDER:] += 0.3
    return Dataset(data.x, y)


def offer(srv, round_: int) -> bool:
    """A round whose personal model is far off the line, so that alone wins."""
    algo = make_client(TaskSpec.from_json(FAST))
    train, empty = drifted(), line(0)
    return srv.offer("speed", algo, linear(-1.0, 0.0), {}, (train, empty, None), (train, empty, {}), round_)


def copies(tmp_path) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    """``(judged copy's arrays and metadata, every-row copy's)`` as saved."""
    return load_arrays(alone_path(tmp_path, "speed")), load_arrays(alone_path(tmp_path, "speed", EVERY))


def twin(model: ServingModel, arrays: dict) -> ServingModel:
    return dataclasses.replace(model, local=arrays, every_row=False, _digest=None)


def test_the_alone_model_that_serves_has_seen_the_newest_rows_and_was_judged_by_its_twin(tmp_path):
    srv = server(tmp_path)
    assert offer(srv, 1)
    status = srv.status()["models"]["speed"]
    assert status["candidate"] == "alone" and status["every_row"] is True
    assert status["evidence"]["serves"] == (
        f"the alone copy trained on all {N} rows, judged by its twin trained on the older {OLDER}"
    )
    model = srv.models["speed"]
    (judged, _), (every, _) = copies(tmp_path)
    for name, value in every.items():  # it serves the copy on every row ...
        assert np.array_equal(model.local[name], value), name
    newest = newest_split(drifted())[1]
    older = twin(model, judged)
    assert model.test_error(newest) < older.test_error(newest) - 2.0  # ... which has seen the drift
    # Its figures are its twin's: the judge's score, the drift reference, the first interval's residuals.
    assert status["evidence"]["scores"]["alone"] == pytest.approx(older.score(newest)[0], abs=1e-6)
    assert model.reference == pytest.approx(older.test_error(newest))
    residuals = np.abs(older.outputs(newest.x)[:, 0] - newest.y[:, 0]) * 50
    assert sorted(model.calibration.array()) == pytest.approx(sorted(residuals))


def test_both_copies_and_the_choice_survive_a_restart_and_go_on_from_their_state(tmp_path):
    srv = server(tmp_path)
    assert offer(srv, 1)
    again = server(tmp_path)  # the trainer restarted: the serving model comes back from disk
    again.start()
    try:
        back = again.status()["models"]["speed"]
        assert back["candidate"] == "alone" and back["every_row"] is True
        assert "judged by its twin" in back["evidence"]["serves"]
        (judged, _), _ = copies(tmp_path)  # the twin of round 1 came back with it, for the gate
        for name, value in judged.items():
            assert np.array_equal(again.models["speed"].judged_by.local[name], value), name
        assert offer(again, 2)  # the copies go on from their saved state, one more round each
    finally:
        again.close()
    (_, judged), (_, every) = copies(tmp_path)
    assert judged["rounds"] == every["rounds"] == 2
    assert again.models["speed"].round == 2 and again.models["speed"].every_row


def test_the_gate_judges_a_serving_copy_on_every_row_by_its_twin_not_on_rows_it_trained_on(tmp_path):
    """Scored on the newest rows, which it trained on, the serving copy would look better than it is
    and keep any new round's model out; its twin of the same round, saved with it, is judged instead."""
    srv = server(tmp_path)
    assert offer(srv, 1)
    newest = newest_split(drifted())[1]
    fits = dataclasses.replace(srv.models["speed"], local={"fc0.weight": np.array([[2.0]], np.float32),
                                                           "fc0.bias": np.array([0.8], np.float32)}, _digest=None)  # fmt: skip
    assert fits.score(newest)[0] == pytest.approx(1.0)  # the newest rows, exactly: as if trained on them
    current = dataclasses.replace(fits, every_row=True, judged_by=dataclasses.replace(fits, every_row=False))
    candidate = dataclasses.replace(fits, candidate="personal", every_row=False, metric=0.9)
    evidence = {"scores": {"personal": 0.9}}
    assert gate.refusal(candidate, evidence, current, newest, None, None, 0.05) is not None  # twin: 1.0
    current.judged_by = twin(current, {"fc0.weight": np.array([[2.0]], np.float32),
                                       "fc0.bias": np.array([0.5], np.float32)})  # fmt: skip
    assert current.judged_by.score(newest)[0] < 0.85  # the twin never saw the drift
    assert gate.refusal(candidate, evidence, current, newest, None, None, 0.05) is None
    # A serving copy with no twin (none was saved) is scored itself: in-sample, the cautious side.
    current.judged_by = None
    why = gate.refusal(candidate, evidence, current, newest, None, None, 0.05)
    assert why is not None and "below the serving round 1's 1.0000" in why


def test_an_unreadable_copy_on_every_row_starts_over_and_leaves_its_twin_alone(tmp_path, caplog):
    srv = server(tmp_path)
    assert offer(srv, 1)
    alone_path(tmp_path, "speed", EVERY).write_bytes(b"not a state file")
    with caplog.at_level(logging.WARNING):
        assert offer(srv, 2)
    assert "alone model on every row is unreadable" in caplog.text
    (_, judged), (_, every) = copies(tmp_path)
    assert judged["rounds"] == 2 and every["rounds"] == 1
    assert json.loads(json.dumps(srv.status()["models"]["speed"]["evidence"]))["serves"]


MINIBATCH = json.dumps(
    json.loads(FAST) | {"hparams": {"loss": "mse", "lr": 0.1, "local_steps": 5, "batch_size": 4}}
)


@pytest.mark.parametrize("task", [FAST, MINIBATCH], ids=["full-batch", "minibatch"])
def test_the_alone_model_is_indiv_as_the_simulator_trains_it_from_the_same_start(tmp_path, task):
    """The studies' *alone* (``benchmarks.newcomer``, ``field_accuracy``) is ``indiv`` in the simulator,
    from the device's seeded start; the device's alone copies started from another draw (a label of
    their own), so on ``make demo``'s newcomer the alone model served 0.87 where indiv had 0.54.  A
    minibatch task's batches are indiv's too (they were drawn from a label of their own: the welders'
    served alone copy in ``field_accuracy`` was not the study's *alone*)."""
    spec = TaskSpec.from_json(task)
    rows = drifted()
    algo = make_client(alone_spec(spec))
    local = initial_local(algo, "p1")
    for round_ in (1, 2, 3):
        _, params = train_alone(tmp_path, "p1", "speed", spec, rows, round_)
        _, local = participate(algo, "p1", {}, local, rows, None, round_=round_, phase="train")
        for name, value in algorithm_state(local).items():
            np.testing.assert_array_equal(params[name], value, err_msg=f"round {round_}: {name}")

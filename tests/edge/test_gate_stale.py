"""The gate on the rows that chose the serving model (``gate.refusal``'s ``stale``): a device whose
rows stop changing (``make demo``'s printers, an idle machine) judges each round's candidates on the
same newest rows, where the serving model's score is the best of every model it already beat.
There the serving model holds only against a candidate that does worse than a constant answer;
on rows that have changed, or for a task whose training changed, the margin holds as before."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge.serving import gate
from tests.edge.test_serving import linear, offer, rows, server
from trainer_lite.data import Dataset


def newest_rows() -> Dataset:
    """Ten rows of one print run at its fastest: speeds that barely vary (R² magnifies every error)."""
    x = np.linspace(0.80, 0.85, 10).reshape(-1, 1)
    return Dataset(x, 2 * x + 0.5)


def models(tmp_path, newest: Dataset):
    """(the serving model: the line itself; a candidate a little off it on ``newest``)."""
    srv = server(tmp_path)
    assert offer(srv, linear(2.0, 0.5), 1, newest)
    current = srv.models["speed"]
    return current, answering(current, 2.0, 0.52, newest)


def answering(model, w: float, b: float, newest: Dataset):
    """``model``'s candidate with the line ``w x + b`` in place of its parameters, scored on ``newest``."""
    params = {"shared": linear(w, b), "local": {}} if model.shared else {"shared": {}, "local": linear(w, b)}
    out = dataclasses.replace(model, **params, candidate="personal", _digest=None)
    out.metric, _ = out.score(newest)
    return out


def test_on_the_rows_that_chose_it_the_serving_model_gives_way_to_a_newer_one_a_little_worse_there(tmp_path):
    newest = newest_rows()
    current, candidate = models(tmp_path, newest)
    old, _ = current.score(newest)
    assert old == pytest.approx(1.0) and candidate.metric < old - 0.05  # 0.02 off: far below in R²
    evidence = {"scores": {"personal": candidate.metric}}
    # Fresh rows (or after a restart): the margin holds, as it always did.
    fresh = gate.refusal(candidate, evidence, current, newest, None, None, 0.05)
    assert fresh is not None and "by more than the margin" in fresh
    # The rows that chose it: the candidate is better than the training rows' constant answer, so it serves.
    constant = gate.constant_answer(rows(40, 0), classes=False)
    assert gate.constant_score("r2", newest, constant) < candidate.metric
    assert gate.refusal(candidate, evidence, current, newest, None, None, 0.05, constant) is None


def test_on_the_rows_that_chose_it_a_candidate_worse_than_a_constant_answer_is_refused(tmp_path):
    """A training that cannot learn (tests/e2e/test_serving.py restarts a task with lr 1e-9)."""
    newest = newest_rows()
    current, _ = models(tmp_path, newest)
    candidate = answering(current, 0.0, 0.0, newest)  # answers 0 to every row: nothing learnt
    constant = gate.constant_answer(rows(40, 0), classes=False)
    floor = gate.constant_score("r2", newest, constant)
    assert candidate.metric < floor <= current.score(newest)[0]
    why = gate.refusal(
        candidate, {"scores": {"personal": candidate.metric}}, current, newest, None, None, 0.05, constant
    )
    assert (
        why is not None
        and "below the training rows' constant answer" in why
        and "round 1 keeps serving" in why
    )


def test_a_constant_answer_scores_as_the_judge_scores_a_model():
    newest = newest_rows()
    mean = gate.constant_answer(newest, classes=False)
    assert gate.constant_score("r2", newest, mean) == pytest.approx(0.0, abs=1e-12)  # the rows' own mean
    labels = Dataset(np.zeros((6, 1)), np.array([2, 2, 1, 2, 0, 2]))
    assert gate.constant_answer(labels, classes=True).tolist() == [2]
    assert gate.constant_score("accuracy", labels, np.array([2])) == pytest.approx(4 / 6)
    assert gate.constant_answer(labels.take(np.arange(0)), classes=True) is None


def test_a_judgement_is_the_same_rows_and_the_same_training(tmp_path):
    newest = newest_rows()
    same = gate.judgement(newest, '{"seed": 0}')
    assert same == gate.judgement(Dataset(newest.x.copy(), newest.y.copy()), '{"seed": 0}')
    assert same != gate.judgement(newest, '{"seed": 7}')  # a task started over: judged by the margin again
    moved = Dataset(newest.x.copy(), newest.y.copy())
    moved.y[-1] += 1e-6  # one new label
    assert same != gate.judgement(moved, '{"seed": 0}')


def test_the_device_remembers_the_judgement_that_installed_its_serving_model(tmp_path):
    srv = server(tmp_path)
    newest = newest_rows()
    assert offer(srv, linear(2.0, 0.5), 1, newest)
    chosen = srv.models["speed"].judged_on
    assert chosen == gate.judgement(newest, srv.models["speed"].algo.spec.to_json())
    assert offer(srv, linear(2.0, 0.5), 2, newest)  # the same rows, the same training: stale, and it serves
    assert srv.models["speed"].judged_on == chosen and srv.models["speed"].round == 2


def test_a_restarted_device_still_knows_the_rows_that_chose_its_serving_model(tmp_path):
    """The judgement is saved with the serving model: after a restart a candidate a little worse on the
    rows that chose it still serves (it was held in memory: a restart brought the margin back, and
    ``make demo``'s printer3 kept a stale model again after each restart)."""
    newest = newest_rows()
    assert offer(server(tmp_path), linear(2.0, 0.5), 1, newest)
    again = server(tmp_path, hold_out_always=True)
    again.start()
    try:
        assert again.models["speed"].round == 1
        assert offer(again, linear(2.0, 0.52), 2, newest), again.gate.get("speed")
        assert again.models["speed"].round == 2
    finally:
        again.close()

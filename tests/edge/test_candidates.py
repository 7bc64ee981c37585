"""The candidates a machine chooses from (``edge.serving.candidates``) and the cold start's held-out check.

Each test drives :meth:`Server.offer` (or an algorithm's cold start) as the daemon does, with rows
stored oldest first as the recorder appends them: the newest ones judge.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from edge.config import ServeConfig
from edge.serving.candidates import GLOBAL, PERSONAL, judge
from edge.serving.records import Answer
from tests.edge.test_serving import SPEC, layer, linear, server
from trainer_lite.algorithms import make_client
from trainer_lite.client import derive_rng
from trainer_lite.data import Dataset, holdout_size, newest_split
from trainer_lite.task import TaskSpec

FAST = json.dumps(json.loads(SPEC) | {"hparams": {"loss": "mse", "lr": 0.1, "local_steps": 200}})


def line(n: int, seed: int = 0) -> Dataset:
    """``y = 2x + 0.5`` in time order (one print run's layers)."""
    x = np.random.default_rng(seed).uniform(0, 1, (n, 1))
    return Dataset(x, 2 * x + 0.5)


def test_the_newest_rows_are_held_out_even_of_a_small_dataset():
    # A fifth, at least one, and at least min(10, n // 4): ten rows calibrate a 90 % interval too.
    assert [holdout_size(n) for n in (0, 1, 2, 5, 6, 30, 40, 100)] == [0, 0, 1, 1, 2, 7, 10, 20]
    older, newest = newest_split(line(30))
    assert (len(older), len(newest)) == (23, 7)
    assert np.array_equal(newest.x, line(30).x[23:])  # the last rows stored, not a random draw


def test_a_personal_model_worse_than_alone_gives_way_to_alone_after_one_print_run(tmp_path):
    """One print run: every row in the training split, none in the test split.  Before the time-ordered
    holdout the round's model was swapped in unchecked; now its own rows' newest seven judge it."""
    srv = server(tmp_path)
    algo = make_client(TaskSpec.from_json(FAST))
    train, empty = line(30), line(0)
    assert srv.offer("speed", algo, linear(-1.0, 0.0), {}, (train, empty, None), (train, empty, {}), 1)
    served = srv.status()["models"]["speed"]
    evidence = served["evidence"]
    assert served["candidate"] == "alone" and evidence["rows"] == 7 and evidence["metric"] == "r2"
    assert evidence["scores"]["alone"] > 0.9 > evidence["scores"]["personal"]
    assert set(evidence["scores"]) == {"personal", "global", "alone"}
    ans = srv.models["speed"].answer(layer("job#1/1", 0.5))
    assert ans.candidate == "alone" and abs(ans.expected_speed - 75.0) < 5.0  # (2·0.5 + 0.5)·50
    assert json.loads(ans.encode())["candidate"] == "alone"
    # The alone model goes on from its saved state next round, in the state folder.
    assert (tmp_path / "serving" / "alone" / "speed.safetensors").exists()


def test_the_round_s_model_serves_when_it_is_the_best(tmp_path):
    srv = server(tmp_path)
    algo = make_client(TaskSpec.from_json(SPEC))
    train, test = line(30), line(10, 1)
    assert srv.offer("speed", algo, linear(2.0, 0.5), {}, (train, test, None), (train, test, {}), 1)
    assert srv.status()["models"]["speed"]["candidate"] == "personal"  # ties go to the round's own


def test_a_newcomer_with_too_few_rows_serves_the_fleet_s_model_through_the_cold_start(tmp_path):
    spec = TaskSpec.from_json(json.dumps({
        "name": "speed", "algorithm": "pflda", "model": "sigmoid_glm", "rounds": 5,
        "hparams": {"lr": 0.1, "local_steps": 5},
    }))  # fmt: skip
    algo = make_client(spec)
    shared = algo.init_global(np.random.default_rng(3))
    local = algo.init_local(np.random.default_rng(4))
    srv = server(tmp_path)
    train = line(8)  # 2 newest rows held out: fewer than min_judge_rows (5)
    assert srv.offer("speed", algo, shared, local, (train, line(0), None), (train, line(0), {}), 4)
    served = srv.status()["models"]["speed"]
    assert served["candidate"] == "global" and served["evidence"]["rows"] == 2
    assert "fewer than the 5 needed to judge" in served["evidence"]["why"]
    assert "cold start" in served["evidence"]["why"]
    model = srv.models["speed"]
    # The fleet's decoder as received (γ starts at w); the encoder is the newcomer's cold start.
    for name in algo.shared_names():
        assert np.array_equal(model.local[f"personal.{name}"], shared[name])
        assert np.array_equal(model.shared[name], shared[name])


def test_answers_read_back_from_older_logs_name_the_personal_model():
    old = {"device": "p1", "task": "speed", "kind": "layer", "key": "job#1/1", "row_time": 1.0,
           "answered_at": 1.5, "latency_s": 0.5, "model": {"task": "speed", "round": 2}}  # fmt: skip
    assert Answer.from_dict(old).candidate == "personal"
    assert Answer.from_dict(old | {"candidate": "alone"}).candidate == "alone"


def test_a_stacked_encoder_s_cold_start_keeps_the_fleet_s_start_when_it_is_better_on_held_out_rows():
    """PFL-DA with ``printer_nn`` (a residual, stacked encoder).  The device's random start fits its
    older rows exactly and the newest ones badly; the start fitted through the fleet's decoder does the
    reverse.  Judged on all its rows the random start looked better and was kept; on the held-out
    newest rows, the fleet's start is kept."""
    spec = TaskSpec.from_json(json.dumps({
        "name": "speed", "algorithm": "pflda", "model": "printer_nn", "rounds": 5,
        "model_args": {"feature_dim": 4, "encoder_hidden": 4, "width": 4, "depth": 2},
        "hparams": {"lr": 0.01, "local_steps": 5},
    }))  # fmt: skip
    algo = make_client(spec)
    shared = algo.init_global(np.random.default_rng(1))
    start = algo.init_local(np.random.default_rng(2))
    other = algo.init_local(np.random.default_rng(5))
    fleet_start = {
        **{n: other[n] for n in algo.encoder_names()},
        **{f"personal.{n}": np.asarray(shared[n]) for n in algo.shared_names()},
    }
    x = np.linspace(-2, 2, 40, dtype=np.float32).reshape(-1, 1)
    h = holdout_size(40)
    older, newest = x[: 40 - h], x[40 - h :]
    y = np.concatenate([algo.predict(shared, start, older), algo.predict(shared, fleet_start, newest)])
    data = Dataset(x, y.astype(np.float32))
    seen: list[int] = []

    def fit_encoder(_shared, _local, rows, _rng):
        seen.append(len(rows))
        return {n: fleet_start[n] for n in algo.encoder_names()}

    algo.fit_encoder = fit_encoder  # the fit itself is not under test: the choice after it is
    got = algo.cold_start(shared, start, data, rng=derive_rng(0, "p9", "cold-start"), phase="train")
    assert seen == [40 - h, 40]  # judged fitted on the older rows; kept, fitted on every row
    for name, value in fleet_start.items():
        assert np.array_equal(got[name], value), name


def test_the_judge_s_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match=r"serve.min_judge_rows must be >= 1, got 0"):
        ServeConfig(min_judge_rows=0)
    with pytest.raises(ValueError, match=r"serve.holdout_fraction must be in \(0, 1\), got 1.0"):
        ServeConfig(holdout_fraction=1.0)


def test_one_lucky_round_does_not_flip_the_served_candidate_but_a_lasting_lead_does(tmp_path):
    """field_accuracy's printers flip-flopped between global and alone each round, judged on one
    round's ten rows; a candidate now serves on its record of rounds (``remember``)."""
    srv = server(tmp_path)
    algo = make_client(TaskSpec.from_json(SPEC))
    train = line(30)
    assert srv.offer("speed", algo, linear(2.0, 0.5), {}, (train, line(0), None), (train, line(0), {}), 1)
    served = srv.status()["models"]["speed"]
    assert set(served["evidence"]["record"]) == {"personal", "global", "alone"}
    assert (tmp_path / "serving" / "judge" / "speed.json").exists()  # the record outlives the round

    model = srv.models["speed"]

    def offset(b: float):  # the task's model, off the line by ``b - 0.5`` everywhere
        return dataclasses.replace(model, shared=linear(2.0, b), local={}, _digest=None)

    newest, record, got = line(10, 7), {}, []
    rounds = [(0.5, 0.9)] + [(0.56, 0.5)] * 3  # (personal's offset, global's): global leads from round 2
    for p, g in rounds:
        name, evidence = judge({PERSONAL: offset(p), GLOBAL: offset(g)}, newest, None, 5, record)
        got.append(name)
    assert got == [PERSONAL, PERSONAL, PERSONAL, GLOBAL]
    assert evidence["scores"][GLOBAL] > evidence["scores"][PERSONAL]  # this round's rows alone
    # Fewer rows than the judge needs: no judgement, and the record is left as it was.
    before = json.dumps(record)
    assert judge({PERSONAL: offset(0.5), GLOBAL: offset(0.5)}, line(3), None, 5, record)[0] == GLOBAL
    assert json.dumps(record) == before

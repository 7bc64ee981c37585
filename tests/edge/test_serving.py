"""Serving's parts without a broker: the answer records, the gate, the answer log's rotation and
torn lines (one test kills a real writer process), and ``edge-trainer predict`` as a process."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge import jsonlog
from edge.config import DeviceConfig, ServeConfig
from edge.feed import RowFeed
from edge.jsonlog import JsonLinesLog, Tail, read_log
from edge.models.onnx import no_worse
from edge.serving.model import Refusal, ServingModel
from edge.serving.offers import model_path
from edge.serving.records import Answer, ModelId, Row
from edge.serving.server import Server
from ioft_protocol import topics
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset, holdout_size
from trainer_lite.task import TaskSpec

SPEC = json.dumps({"name": "speed", "algorithm": "fedavg", "model": "mlp",
                   "model_args": {"sizes": [1, 1]}, "hparams": {"loss": "mse"}})  # fmt: skip


def linear(w: float, b: float) -> dict[str, np.ndarray]:
    return {"fc0.weight": np.array([[w]], np.float32), "fc0.bias": np.array([b], np.float32)}


def rows(n: int, seed: int) -> Dataset:
    """``y = 2x + 0.5`` (speed/50 against sigma_a, as a printer's dataset stores them)."""
    x = np.random.default_rng(seed).uniform(0, 1, (n, 1))
    return Dataset(x, 2 * x + 0.5)


def server(tmp_path: Path, published: list | None = None, **serve) -> Server:
    config = DeviceConfig(device="p1", state_dir=str(tmp_path), serve=ServeConfig(**serve))
    out = published if published is not None else []
    return Server(config, tmp_path, lambda topic, payload: out.append((topic, payload)))


def with_newest(newest: Dataset, seed: int = 0) -> Dataset:
    """Training rows whose newest held-out rows (``Server.holdout``) are exactly ``newest``."""
    n = len(newest) + 1
    while holdout_size(n) != len(newest):
        n += 1
    older = rows(n - len(newest), seed)
    return Dataset(np.concatenate([older.x, newest.x]), np.concatenate([older.y, newest.y]))


def offer(srv: Server, params: dict, round_: int, test: Dataset | None = None) -> bool:
    """``params`` offered after round ``round_``; ``test``: the newest rows, which judge and calibrate."""
    algo = make_client(TaskSpec.from_json(SPEC))
    train = rows(40, 0) if test is None else with_newest(test)
    none = train.take(np.arange(0))
    return srv.offer("speed", algo, params, {}, (train, none, None), (train, none, {}), round_)


def layer(key: str, sigma_a: float, commanded: float = 40.0) -> Row:
    return Row("layer", key, time.time(), (sigma_a,), commanded=commanded)


# -- records ------------------------------------------------------------------------------
def test_a_row_and_an_answer_round_trip_with_every_identity_field():
    row = Row("weld", "w-00012", 1.5e9, (0.25, -1.0), schema_hash="abc")
    assert Row.from_json(row.to_json()) == row
    ans = Answer("p1", "speed", "layer", "job#3/12", 10.0, 10.002, 0.002, ModelId("speed", 4, "0123456789ab"),
                 expected_speed=80.0, commanded=40.0, residual=40.0)  # fmt: skip
    back = Answer.from_dict(json.loads(ans.encode()))
    assert back == ans
    assert json.loads(ans.encode())["model"] == {"task": "speed", "round": 4, "digest": "0123456789ab"}


def test_an_answer_encodes_every_set_field_in_declaration_order():
    """``to_dict`` is hand-written (``dataclasses.asdict`` cost half an answer's CPU): the same
    record as asdict's, None fields left out, the model's too, ``extra`` last."""
    weld = Answer("w1", "tool", "weld", "w-7", 1.0, 1.001, 0.001, ModelId("tool", 3, "ab", "enc", 2),
                  classes=["TC1", "TC2"], probabilities=[0.25, 0.75], predicted="TC2", extra={"x": {"y": 1}})  # fmt: skip
    layer = Answer("p1", "speed", "layer", "job#1/2", 5.0, 5.5, 0.5, ModelId("speed", 1),
                   expected_speed=41.0, commanded=40.0, residual=1.0)  # fmt: skip
    for ans in (weld, layer):
        want = {k: v for k, v in dataclasses.asdict(ans).items() if v is not None and k != "extra"}
        want["model"] = {k: v for k, v in dataclasses.asdict(ans.model).items() if v is not None}
        if ans.predicted is not None:
            want["label"] = ans.predicted  # its old name, published beside it for one version
        want |= ans.extra
        got = ans.to_dict()
        assert got == want and list(got) == list(want)
        assert Answer.from_dict(json.loads(ans.encode())) == dataclasses.replace(ans, extra={})


def test_a_welds_predicted_class_is_named_predicted_and_its_old_name_still_reads():
    """``label`` is the word for the maintenance log's truth: the answer's guess is ``predicted``.
    For one version the answer carries both and reads either (a log or a device from before)."""
    body = Answer("w1", "tool", "weld", "w-7", 1.0, 1.001, 0.001, ModelId("tool", 3),
                  classes=["TC1", "TC4"], probabilities=[0.2, 0.8], predicted="TC4").to_dict()  # fmt: skip
    assert body["predicted"] == body["label"] == "TC4"
    old = {k: v for k, v in body.items() if k != "predicted"}  # as a device not upgraded yet writes it
    assert Answer.from_dict(old).predicted == Answer.from_dict(body).predicted == "TC4"
    with pytest.raises(ValueError, match="answer predicted must be a string"):
        Answer.from_dict(body | {"predicted": 4})


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"kind": "bolt", "key": "k", "time": 1, "x": [1]}', "kind"),
        ('{"kind": "layer", "key": "", "time": 1, "x": [1]}', "key"),
        ('{"kind": "layer", "key": "k", "time": "now", "x": [1]}', "time"),
        ('{"kind": "layer", "key": "k", "time": 1, "x": []}', "x"),
        ('{"kind": "layer", "key": "k", "time": 1, "x": [1], "commanded": NaN}', "commanded"),
        ("[1, 2]", "object"),
    ],
)
def test_a_bad_row_is_refused_naming_its_field(line, field):
    with pytest.raises(ValueError, match=field):
        Row.from_json(line)


# -- the model and its gate ---------------------------------------------------------------
def test_the_serving_model_answers_a_layer_with_speed_and_residual(tmp_path):
    srv = server(tmp_path)
    assert offer(srv, linear(2.0, 0.5), 1)
    ans = srv.models["speed"].answer(layer("job#1/3", 0.5, commanded=40.0))
    assert ans.expected_speed == pytest.approx(1.5 * 50)  # y = speed / 50
    assert ans.residual == pytest.approx(75.0 - 40.0)
    assert (ans.model.task, ans.model.round) == ("speed", 1) and ans.latency_s >= 0


def test_no_worse_is_the_rollback_rule():
    assert no_worse(0.80, 0.84, 0.05) and not no_worse(0.78, 0.84, 0.05)
    assert no_worse(None, 0.9, 0.05) and no_worse(0.1, None, 0.05)


def test_the_gate_refuses_a_worse_model_and_the_better_one_keeps_serving(tmp_path):
    srv = server(tmp_path, margin=0.05)
    assert offer(srv, linear(2.0, 0.5), 1)
    good = srv.models["speed"].digest
    assert not offer(srv, linear(0.0, 0.0), 2)  # predicts 0 everywhere: worse than a constant answer
    assert srv.models["speed"].digest == good and srv.status()["gate"]["speed"].startswith("round 2:")
    saved = ServingModel.load(model_path(tmp_path, "speed"), device="p1", task="speed")
    assert saved is not None and saved.digest == good  # the file on disk is the serving one


def test_on_rows_that_came_since_the_margin_decides(tmp_path):
    """New newest rows each round (a printer printing): a candidate within ``margin`` of the serving
    model serves, one further below does not (on unchanged rows: tests/edge/test_gate_stale.py)."""
    srv = server(tmp_path, margin=0.05)
    assert offer(srv, linear(2.0, 0.5), 1, rows(10, 1))
    assert offer(srv, linear(1.98, 0.5), 2, rows(10, 2))  # within the margin: it serves
    assert srv.models["speed"].round == 2 and "speed" not in srv.status()["gate"]
    assert not offer(srv, linear(1.4, 0.8), 3, rows(10, 3))  # R² about 0.9 against 1.0
    why = srv.status()["gate"]["speed"]
    assert why.startswith("round 3:") and "by more than the margin 0.05" in why
    assert srv.models["speed"].round == 2


def test_a_model_with_answers_that_are_not_finite_never_serves(tmp_path):
    srv = server(tmp_path)
    assert offer(srv, linear(np.nan, 0.0), 1)  # the round's and the fleet's answer NaN: its own serves
    served = srv.status()["models"]["speed"]
    assert served["candidate"] == "alone" and np.isfinite(srv.models["speed"].local["fc0.weight"]).all()
    assert served["evidence"]["scores"]["personal"] is None and served["evidence"]["scores"]["global"] is None


def test_another_machines_or_tasks_model_is_not_loaded(tmp_path):
    srv = server(tmp_path)
    offer(srv, linear(2.0, 0.5), 1)
    with pytest.raises(ValueError, match="not 'p2'"):
        ServingModel.load(model_path(tmp_path, "speed"), device="p2", task="speed")
    os.replace(model_path(tmp_path, "speed"), model_path(tmp_path, "other"))
    with pytest.raises(ValueError, match="task 'speed'"):
        ServingModel.load(model_path(tmp_path, "other"), device="p1", task="other")


def test_rows_the_model_cannot_take_are_refused_and_counted(tmp_path, caplog):
    published: list = []
    srv = server(tmp_path, published)
    srv.start()
    try:
        assert srv.answer(layer("job#1/1", 0.3)) == 0  # before any round: no model
        offer(srv, linear(2.0, 0.5), 1)
        assert srv.answer(layer("job#1/2", 0.3)) == 1
        wide = Row("layer", "job#1/3", time.time(), (0.3, 0.4))
        weld = Row("weld", "w1", time.time(), (0.3,), schema_hash="abc")
        assert srv.answer(wide) == 0 and srv.answer(weld) == 0
        # A model whose answer is not finite is taken out of service, and said so once.
        srv.models["speed"].shared["fc0.weight"][:] = np.inf
        with caplog.at_level(logging.WARNING):
            assert srv.answer(layer("job#1/4", 0.3)) == 0
            assert srv.answer(layer("job#1/5", 0.3)) == 0
    finally:
        srv.close()
    st = srv.status()
    assert st["answered"] == {"speed": 1}
    assert st["refused"] == {
        "*": {Refusal.NO_MODEL.value: 2},
        "speed": {Refusal.WIDTH.value: 1, Refusal.SCHEMA.value: 1, Refusal.NOT_FINITE.value: 1},
    }
    assert sum("NaN or Inf" in r.message for r in caplog.records) == 1
    assert [t for t, _ in published] == ["ioft/v1/default/answer/p1/speed"]


def test_the_server_answers_what_the_recorder_feeds(tmp_path):
    published: list = []
    srv = server(tmp_path, published)
    offer(srv, linear(2.0, 0.5), 1)
    srv.start()
    feed = RowFeed(tmp_path)
    try:
        for i in range(5):
            feed.put(layer(f"job#1/{i}", 0.1 * i))
        deadline = time.monotonic() + 30
        while len(published) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        feed.close()
        srv.close()
    assert [json.loads(p)["key"] for _, p in published] == [f"job#1/{i}" for i in range(5)]
    assert [r["key"] for r in read_log(tmp_path / "serving" / "answers.jsonl")[0]] == [
        f"job#1/{i}" for i in range(5)
    ]


# -- the log ------------------------------------------------------------------------------
def test_the_log_rotates_by_size_and_stays_bounded(tmp_path):
    path = tmp_path / "a.jsonl"
    log = JsonLinesLog(path, max_bytes=200, keep=2)
    for i in range(100):
        log.append({"i": i, "pad": "x" * 20})
    log.close()
    assert len(jsonlog.log_files(path)) == 3 and sum(p.stat().st_size for p in jsonlog.log_files(path)) <= 600
    records, skipped = read_log(path)
    got = [r["i"] for r in records]
    assert skipped == 0 and got == list(range(got[0], 100))  # the newest, in order


def test_the_log_rotates_by_age(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(jsonlog.time, "time", lambda: now[0])
    log = JsonLinesLog(tmp_path / "a.jsonl", max_bytes=1 << 20, max_age_s=60, keep=3)
    log.append({"i": 1})
    now[0] += 61
    log.append({"i": 2})
    log.close()
    assert [p.name for p in jsonlog.log_files(tmp_path / "a.jsonl")] == ["a.jsonl.1", "a.jsonl"]


def test_a_torn_last_line_is_skipped_and_the_next_writer_goes_on(tmp_path):
    path = tmp_path / "a.jsonl"
    log = JsonLinesLog(path)
    log.append({"i": 1})
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"i": 2, "pad"')  # a writer killed mid-line
    assert read_log(path) == ([{"i": 1}], 1)
    log = JsonLinesLog(path)
    log.append({"i": 3})
    log.close()
    assert read_log(path) == ([{"i": 1}, {"i": 3}], 1)


WRITER = """
import sys
from edge.jsonlog import JsonLinesLog
log = JsonLinesLog(sys.argv[1], max_bytes=20000, keep=2)
i = 0
while True:
    log.append({"i": i, "pad": "x" * 200})
    i += 1
    if i == 50:
        print("writing", flush=True)
"""


def test_a_killed_writer_loses_at_most_the_line_it_was_writing(tmp_path):
    path = tmp_path / "a.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(2):  # killed twice, restarted between: the log stays readable
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline() == b"writing\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    records, skipped = read_log(path)
    assert skipped <= 2 and len(records) >= 50
    log = JsonLinesLog(path, max_bytes=20000, keep=2)
    log.append({"after": True})
    log.close()
    assert read_log(path)[0][-1] == {"after": True}


def test_a_tail_follows_the_log_across_rotations_and_resumes(tmp_path):
    path = tmp_path / "a.jsonl"
    log = JsonLinesLog(path, max_bytes=300, keep=3)
    tail = Tail(path)
    seen = []
    for i in range(40):
        log.append({"i": i})
        if i % 7 == 0:
            seen += [r["i"] for r in tail.read()]
    seen += [r["i"] for r in tail.read()]
    assert seen == list(range(40))
    pos = tail.position
    tail.close()
    log.append({"i": 40})
    resumed = Tail(path, pos)
    assert [r["i"] for r in resumed.read()] == [40]
    resumed.close()
    log.close()


# -- edge-trainer predict -----------------------------------------------------------------
def test_predict_prints_an_answer_per_row_and_refuses_bad_input_in_one_line(tmp_path):
    offer(server(tmp_path), linear(2.0, 0.5), 1)
    toml = tmp_path / "device.toml"
    toml.write_text(f'device = "p1"\nstate_dir = "{tmp_path}"\n')
    good = tmp_path / "rows.jsonl"
    good.write_text('{"sigma_a": 0.5, "speed": 40, "key": "a"}\n{"x": [0.1]}\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def predict(path: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "edge.cli", "predict", "--config", str(toml), str(path)]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

    done = predict(good)
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert [a["key"] for a in out] == ["a", "rows.jsonl:2"]
    assert out[0]["expected_speed"] == pytest.approx(75.0) and out[0]["residual"] == pytest.approx(35.0)
    bad = tmp_path / "bad.jsonl"
    for text in ('{"x": [0.1, 0.2]}\n', "not json\n"):
        bad.write_text(text)
        done = predict(bad)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr


class Encoder:
    """Stands in for an active ONNX encoder (:class:`edge.models.onnx.LoadedModel`): version and run."""

    def __init__(self, version: int) -> None:
        self.version = version

    def run(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float32)[:, :1] * 2


def test_a_task_that_embeds_rows_answers_only_with_its_encoder_version(tmp_path):
    encoders = {"enc": Encoder(3)}
    config = DeviceConfig(device="p1", state_dir=str(tmp_path))
    srv = Server(config, tmp_path, lambda *_: None, encoders.get)
    spec = json.loads(SPEC) | {"hparams": {"loss": "mse", "features": "onnx:enc"}}
    algo = make_client(TaskSpec.from_json(json.dumps(spec)))
    raw = Dataset(np.hstack([rows(40, 0).x, np.zeros((40, 2))]), rows(40, 0).y)  # 3 raw features, 1 embedded
    emb = Dataset(raw.x[:, :1] * 2, raw.y)
    assert srv.offer("speed", algo, linear(1.0, 0.5), {}, (emb, emb, 3), (raw, raw, {}), 1)
    model = srv.models["speed"]
    assert (model.width, model.encoder, model.encoder_version) == (3, "enc", 3)
    row = Row("layer", "job#1/1", time.time(), (0.5, 0.0, 0.0), commanded=40.0)
    ans = model.answer(row, encoders["enc"])
    assert ans.expected_speed == pytest.approx((1.0 * 1.0 + 0.5) * 50)
    assert (ans.model.encoder, ans.model.encoder_version) == ("enc", 3)
    encoders["enc"] = Encoder(4)  # a newer encoder was pushed: this model was not trained on it
    assert srv.answer(row) == 0 and srv.status()["refused"]["speed"] == {Refusal.ENCODER.value: 1}


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.01)


def test_rows_fed_while_the_trainer_was_down_are_answered_when_it_is_back(tmp_path):
    published: list = []
    srv = server(tmp_path, published)
    offer(srv, linear(2.0, 0.5), 1)
    srv.start()
    feed = RowFeed(tmp_path)
    try:
        feed.put(layer("job#1/0", 0.1))
        wait_for(lambda: len(published) == 1, "the first answer")
        srv.close()  # the trainer stops (its feed position is saved)
        for i in (1, 2):
            feed.put(layer(f"job#1/{i}", 0.1))  # the recorder goes on meanwhile
        again = server(tmp_path, published)  # restarted: the model comes back from disk
        again.start()
        feed.put(layer("job#1/3", 0.1))
        wait_for(lambda: len(published) == 4, "answers for the rows fed while it was down")
        again.close()
    finally:
        feed.close()
    assert [json.loads(p)["key"] for _, p in published] == [f"job#1/{i}" for i in range(4)]
    assert {json.loads(p)["model"]["round"] for _, p in published} == {1}


def test_the_answer_topic_is_per_device_and_task_and_parses_back():
    topic = topics.topic_answer("plant", "welder2", "tool")
    assert topic == "ioft/v1/plant/answer/welder2/tool"
    assert topics.parse_topic(topic) == topics.Topic("answer", "plant", task="tool", device="welder2")
    assert topics.topic_answer_all("plant") == "ioft/v1/plant/answer/+/+"
    assert topics.topic_answer_all("plant", "welder2") == "ioft/v1/plant/answer/welder2/+"

"""Watching the machines without a broker: alert rules (k of n, hysteresis, cooldown, restart), speed
advice (and sending it to a simulated Moonraker), field scores and drift, ``predict --advice``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge.config import DeviceConfig
from edge.config_sensors import SensorsConfig
from edge.config_serve import AlertRule, ServeConfig
from edge.feed import RowFeed
from edge.serving.advice import speed_advice
from edge.serving.alerts import Alerts
from edge.serving.field import FieldScores
from edge.serving.model import ServingModel
from edge.serving.records import Answer, ModelId, Row
from edge.serving.server import ANSWER_LOG, Server
from ioft_protocol import topics
from ioft_protocol.config import ConfigError, build
from sensors.sim.printer_host import FakeMoonraker, short_timeline
from tests.edge.test_serving import layer, linear, offer, server

WORN = AlertRule(name="worn_tool", task="tool", value="p:TC4", above=0.8, k=4, n=5, clear_below=0.5)
WELD_SPEC = json.dumps({"name": "tool", "algorithm": "fedavg", "model": "mlp",
                        "model_args": {"sizes": [2, 2]}, "hparams": {"loss": "cross_entropy"}})  # fmt: skip


def weld_answer(key: str, p_worn: float, t: float = 0.0, task: str = "tool") -> Answer:
    return Answer("w1", task, "weld", key, t, t, 0.0, ModelId(task, 1), classes=["TC1", "TC4"],
                  probabilities=[1 - p_worn, p_worn], predicted="TC4" if p_worn > 0.5 else "TC1")  # fmt: skip


def feed(alerts: Alerts, values: list[float], t0: float = 0.0) -> list[tuple[int, str]]:
    """Feed one answer per value (row time t0 + i); the (index, state) of every event."""
    out = []
    for i, v in enumerate(values):
        out += [(i, e.state) for e in alerts.observe(weld_answer(f"w{i}", v, t0 + i))]
    return out


# -- alert rules --------------------------------------------------------------------------
def test_an_alert_is_raised_at_k_of_n_and_only_once(tmp_path):
    alerts = Alerts("w1", [WORN], tmp_path)
    # 3 of the last 5 over 0.8 (rows 2..5): nothing; row 6 makes it 4 of 5; more worn welds raise nothing more.
    assert feed(alerts, [0.9, 0.1, 0.9, 0.9, 0.1, 0.95, 0.9, 0.9, 0.9, 0.9, 0.9]) == [(6, "raised")]
    assert [a["rule"] for a in alerts.status()] == ["worn_tool"]
    assert alerts.status()[0]["key"] == "w6" and alerts.status()[0]["votes"] == 4


def test_hysteresis_values_between_the_thresholds_change_nothing(tmp_path):
    alerts = Alerts("w1", [WORN], tmp_path)
    assert feed(alerts, [0.9] * 4) == [(3, "raised")]
    # 0.6 .. 0.79: below the raise threshold but above clear_below: the alert stays open, no flood.
    assert feed(alerts, [0.6, 0.7, 0.79, 0.65] * 5, t0=10) == []
    assert feed(alerts, [0.2, 0.9, 0.1, 0.3, 0.4], t0=40) == [(4, "cleared")]
    assert alerts.status() == []
    # A closed rule between the thresholds stays closed.
    assert feed(alerts, [0.7] * 10, t0=50) == []


def test_a_cooldown_holds_the_next_raise_back_for_that_long_in_row_time(tmp_path):
    rule = AlertRule(name="hot", task="tool", value="p:TC4", above=0.8, k=2, n=2, cooldown_s=100.0)
    alerts = Alerts("w1", [rule], tmp_path)
    assert feed(alerts, [0.9, 0.9, 0.1, 0.1]) == [(1, "raised"), (3, "cleared")]  # cleared at t = 3
    assert feed(alerts, [0.9] * 10, t0=4) == []  # t = 4..13: inside the cooldown
    # t = 103, 100 s after the clear: the window is full of worn rows already, so it raises at once.
    assert feed(alerts, [0.9, 0.9], t0=103) == [(0, "raised")]


def test_open_alerts_survive_a_restart_and_clear_afterwards(tmp_path):
    alerts = Alerts("w1", [WORN], tmp_path)
    feed(alerts, [0.9] * 4)
    before = alerts.status()
    again = Alerts("w1", [WORN], tmp_path)  # a new process: read back from serving/alerts.json
    assert again.status() == before
    assert feed(again, [0.9] * 5) == []  # still open: not raised a second time
    assert feed(again, [0.1] * 4) == [(3, "cleared")]
    assert Alerts("w1", [WORN], tmp_path).status() == []
    # A rule taken out of device.toml does not come back open.
    feed(again, [0.9] * 4)
    assert Alerts("w1", [], tmp_path).status() == []


def test_the_rules_read_residuals_and_ignore_answers_without_the_value(tmp_path):
    rule = AlertRule(name="shaky", task="speed", value="abs_residual", above=20.0, k=3, n=3)
    alerts = Alerts("p1", [rule], tmp_path)
    mk = lambda i, r: Answer("p1", "speed", "layer", f"j#1/{i}", i, i, 0, ModelId("speed", 1),  # noqa: E731
                             expected_speed=40 + r, commanded=40.0, residual=r)  # fmt: skip
    events = [e.state for i, r in enumerate([-25, 30, -21, 5]) for e in alerts.observe(mk(i, r))]
    assert events == ["raised"]
    assert alerts.observe(weld_answer("w", 0.9, task="speed")) == [] and alerts.unknown_values == 1


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ({"value": "p:TC4", "above": 0.8, "k": 6, "n": 5}, "k <= n"),
        ({"value": "vibration", "above": 1.0}, "value must be one of"),
        ({"value": "residual", "above": 1.0, "clear_below": 2.0}, "must not exceed"),
    ],
)
def test_a_bad_rule_is_one_config_error_naming_it(rule, words):
    raw = {"device": "w1", "serve": {"alerts": [{"name": "r1", "task": "tool", **rule}]}}
    with pytest.raises(ConfigError) as err:
        build(DeviceConfig, raw, "device.toml")
    assert words in str(err.value) and "r1" in str(err.value)


def test_the_alert_topic_is_per_device_and_rule_and_parses_back():
    t = topics.topic_alert("plant", "w1", "worn_tool")
    assert t == "ioft/v1/plant/alert/w1/worn_tool"
    parsed = topics.parse_topic(t)
    assert (parsed.kind, parsed.device, parsed.rule) == ("alert", "w1", "worn_tool")


# -- speed advice -------------------------------------------------------------------------
def serving_line(srv: Server, w: float, b: float) -> ServingModel:
    """The model serving after a round, answering ``speed/50 = w sigma_a + b`` (whichever candidate won
    the round, with its trained range and bounds): the advice of a given model."""
    m = srv.models["speed"]
    line = {"shared": linear(w, b), "local": {}} if m.shared else {"shared": {}, "local": linear(w, b)}
    return dataclasses.replace(m, **line, _digest=None)


def test_the_advice_is_the_highest_speed_within_the_vibration_budget(tmp_path):
    srv = server(tmp_path, vibration_budget=0.6)
    offer(srv, linear(2.0, 0.5), 1)  # speed/50 = 2 sigma_a + 0.5: at 0.6, 85 mm/s
    assert speed_advice(srv.models["speed"], 0.6).speed == pytest.approx(85.0)
    falling = server(tmp_path / "b")
    offer(falling, linear(-2.0, 2.5), 1)
    m = serving_line(falling, -2.0, 2.5)  # falls with vibration: the best is at the least trained sigma_a
    assert speed_advice(m, 0.6).speed == pytest.approx(min(125.0 - 100 * m.sigma_min, m.speed_max))


def test_an_untrained_model_that_expects_no_real_speed_advises_nothing(tmp_path):
    """A model expecting 0 or a negative speed (an early round's) must never cap a printer there."""
    srv = server(tmp_path, vibration_budget=1.0)
    offer(srv, linear(0.0, -0.0075), 1)
    assert speed_advice(serving_line(srv, 0.0, -0.0075), 1.0).speed is None  # expects -0.37 mm/s everywhere
    slow = server(tmp_path / "b")
    offer(slow, linear(0.0, 0.05), 1)
    assert "below min_advice" in speed_advice(serving_line(slow, 0.0, 0.05), 1.0).why  # 2.5 mm/s


def test_each_layer_answer_carries_the_advice_and_the_status_too(tmp_path):
    published: list = []
    srv = server(tmp_path, published, vibration_budget=0.6)
    offer(srv, linear(2.0, 0.5), 1)
    srv.answer(layer("job#1/0", 0.2, commanded=45.0))  # as expected: the interval stays at 0 mm/s
    body = json.loads(published[-1][1])
    assert body["advice"] == {"speed": pytest.approx(85.0), "vibration_budget": 0.6}
    assert Answer.from_dict(body).key == "job#1/0"  # the record still reads back
    assert srv.status()["advice"]["speed"]["speed"] == pytest.approx(85.0)


def moonraker_server(tmp_path: Path, published: list, dry_run: bool, url: str, **serve) -> Server:
    serve = ServeConfig(**{"vibration_budget": 0.6, "apply": "moonraker", "dry_run": dry_run, **serve})
    sensors = SensorsConfig(kind="printer", moonraker_url=url)
    config = DeviceConfig(device="p1", state_dir=str(tmp_path), serve=serve, sensors=sensors)
    return Server(config, tmp_path, lambda topic, payload: published.append((topic, payload)))


def test_moonraker_gets_the_advice_once_per_print_run_and_a_dry_run_sends_nothing(tmp_path, caplog):
    timeline, _ = short_timeline(time.monotonic(), layers=2, dur=1.0, job="x.gcode")
    moonraker = FakeMoonraker(timeline, time.monotonic)
    moonraker.print_state = "printing"
    try:
        dry = moonraker_server(tmp_path / "a", [], True, moonraker.url)
        offer(dry, linear(2.0, 0.5), 1)
        with caplog.at_level("INFO"):
            dry.answer(layer("job#1/0", 0.2))
            wait_for(lambda: dry.moonraker.would_send == 1, "the dry run")
        assert moonraker.scripts == []
        assert "dry run: would send POST" in caplog.text and "SET_VELOCITY_LIMIT" in caplog.text
        live = moonraker_server(tmp_path / "b", [], False, moonraker.url)
        offer(live, linear(2.0, 0.5), 1)
        for key in ("job#1/0", "job#1/1", "job#1/2", "job#2/0", "job#2/1"):
            live.answer(layer(key, 0.2, commanded=45.0))  # as expected: the interval stays as it was
        wait_for(lambda: live.status()["moonraker"]["sent"] == 2, "two print runs sent")
        assert moonraker.scripts == ["SET_VELOCITY_LIMIT VELOCITY=85.0"] * 2  # print runs 1 and 2
        moonraker.down = True  # klippy disconnected: counted, logged, serving goes on
        assert live.answer(layer("job#3/0", 0.2)) == 1
        wait_for(lambda: live.status()["moonraker"]["failed"] == 1, "the failure counted")
        dry.close()
        live.close()
    finally:
        moonraker.close()


def test_apply_without_a_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="vibration_budget"):
        build(DeviceConfig, {"device": "p1", "serve": {"apply": "moonraker"}}, "device.toml")


# -- field scores -------------------------------------------------------------------------
def test_a_late_label_scores_the_earlier_answer_and_drift_is_flagged():
    field = FieldScores(window=4, margin=0.1)
    for i, p in enumerate([0.9, 0.9, 0.2, 0.9]):
        field.answered(weld_answer(f"w{i}", p))
    assert field.status({"tool": 0.9})["tool"]["awaiting_labels"] == 4
    assert field.label("w0", "TC4") == [("tool", True)]
    assert field.label("w1", "TC1") == [("tool", False)]
    assert field.label("nope", "TC1") == [] and field.unknown_labels == 1
    s = field.status({"tool": 0.9})["tool"]
    assert (s["metric"], s["value"], s["n"], s["drift"]) == ("accuracy", 0.5, 2, True)  # 0.5 < 0.9 - 0.1
    field.label("w2", "TC1")
    field.label("w3", "TC4")
    assert field.status({"tool": 0.7})["tool"]["drift"] is False  # 0.75 is within 0.1 of 0.7


def test_a_layer_is_scored_at_once_by_its_error_against_the_test_split(tmp_path):
    srv = server(tmp_path, field_window=4)
    offer(srv, linear(2.0, 0.5), 1)  # the test split fits exactly: reference error ~0
    for i in range(4):
        srv.answer(layer(f"job#1/{i}", 0.2, commanded=40.0))  # expected 45: error 5 mm/s
    s = srv.status()["field"]["speed"]
    assert (s["metric"], s["n"]) == ("error", 4)
    assert s["value"] == pytest.approx(5.0, abs=1e-3) and s["drift"] is True


@pytest.mark.parametrize("log_from", ["this version", "not upgraded"])
def test_labels_fed_by_the_recorder_score_answers_also_after_a_restart(tmp_path, log_from):
    model = ServingModel("p1", "tool", WELD_SPEC, 1, linear_2x2(), {}, width=2, classes=["TC1", "TC4"],
                         metric=1.0, reference=1.0)  # fmt: skip
    srv = server(tmp_path)
    srv.models["tool"] = model
    srv.start()
    rows = RowFeed(tmp_path)
    try:
        for i, x in enumerate([(0.0, 3.0), (3.0, 0.0), (0.0, 3.0)]):
            rows.put(Row("weld", f"w{i}", time.time(), x))
        wait_for(lambda: srv.answered["tool"] == 3, "three answers")
        first = srv.status()
    finally:
        srv.close()
    if log_from == "not upgraded":  # its answers named the predicted class "label" only
        log = srv.dir / ANSWER_LOG
        old = [
            {k: v for k, v in json.loads(line).items() if k != "predicted"}
            for line in log.read_text().splitlines()
        ]
        log.write_text("".join(json.dumps(r) + "\n" for r in old))
    srv = server(tmp_path)  # restarted: the answers waiting for labels come back from the log
    srv.models["tool"] = model
    srv.start()
    # its counts start again, and say since when (the console's counters' _created)
    assert first["answered"] == {"tool": 3} and srv.status()["answered"] == {}
    assert srv.status()["counting_since"] >= first["counting_since"] > 0
    try:
        rows.put_label("w0", "TC4")  # right
        rows.put_label("w1", "TC4")  # wrong: it answered TC1
        rows.put_label("w9", "TC1")  # never answered: counted, ignored
        wait_for(lambda: srv.status()["unknown_labels"] == 1, "the labels read")
        field = srv.status()["field"]["tool"]
        assert (field["value"], field["scored"], field["awaiting_labels"]) == (0.5, 2, 1)
    finally:
        rows.close()
        srv.close()


def linear_2x2() -> dict[str, np.ndarray]:
    return {"fc0.weight": np.eye(2, dtype=np.float32), "fc0.bias": np.zeros(2, np.float32)}


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- edge-trainer predict --advice ----------------------------------------------------------
def test_predict_advice_prints_the_speed_and_says_what_is_missing(tmp_path):
    offer(server(tmp_path), linear(2.0, 0.5), 1)
    toml = tmp_path / "device.toml"
    toml.write_text(f'device = "p1"\nstate_dir = "{tmp_path}"\n[serve]\nvibration_budget = 0.6\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "edge.cli", "predict", *a], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)  # fmt: skip
    done = run("--config", str(toml), "--advice")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["advice"] == {"speed": pytest.approx(85.0), "vibration_budget": 0.6}
    assert out["model"]["round"] == 1
    assert json.loads(run("--config", str(toml), "--advice", "--budget", "0.1").stdout)["advice"][
        "speed"
    ] == pytest.approx(35.0)
    toml.write_text(f'device = "p1"\nstate_dir = "{tmp_path}"\n')
    done = run("--config", str(toml), "--advice")
    assert done.returncode == 2 and "vibration_budget" in done.stderr and "Traceback" not in done.stderr
    for bad in ("-1", "0", "nan"):  # a sign slip is named as such, not read as "no budget"
        done = run("--config", str(toml), "--advice", "--budget", bad)
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.strip().splitlines() == [
            f"edge-trainer: --budget must be a positive number (in the units of sigma_a), got {bad}"
        ], done.stderr

"""Alert rules that say what to do and that can fire: a rule naming a task or class that does not exist
is refused at start in one line; ``action`` and ``[serve.classes]`` ride on the alert, the status and
Home Assistant; a rule that cannot fire yet says so in the status (issue 33, item 3)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from edge.config import DeviceConfig
from edge.config_sensors import SensorsConfig
from edge.config_serve import AlertRule, ServeConfig
from edge.dataset import save_dataset
from edge.serving.alerts import Alerts, check_rules
from edge.serving.model import ServingModel
from edge.serving.records import Row
from ioft_protocol import topics
from ioft_protocol.config import ConfigError, build
from tests.edge.test_home_assistant import WELD_SPEC, configs, linear_2x2, render, welder
from tests.edge.test_serving_watch import feed, moonraker_server, wait_for
from trainer_lite.data import Dataset

TOOL_M = ["TC1", "TC2", "TC3", "TC4"]
WORDS = {"action": "replace the horn"}


def rule(value: str = "p:TC4", task: str = "tool", **more) -> AlertRule:
    return AlertRule(name="worn_tool", task=task, value=value, above=0.8, k=1, n=1, **more)


def device(*rules: AlertRule, classes: dict | None = None, **more) -> DeviceConfig:
    serve = ServeConfig(alerts=list(rules), classes=classes or {})
    return DeviceConfig(device="w1", serve=serve, **more)


# -- refused at start ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "meta", "words"),
    [
        ("p:TC9", {"classes": TOOL_M}, "'TC9' is not one of task tool's classes (TC1, TC2, TC3, TC4)"),
        ("abs_residual", {"classes": TOOL_M}, "reads a speed, but task tool answers a class"),
        ("p:TC4", {"source": "printer"}, "reads a class probability, but task tool predicts a speed"),
    ],
)
def test_a_rule_that_can_never_fire_is_refused_by_the_datasets_classes(value, meta, words):
    problems, note = check_rules(device(rule(value)), meta)
    assert len(problems) == 1 and words in problems[0] and "worn_tool" in problems[0], problems
    assert "the dataset's metadata" in problems[0] and note is None


def test_with_no_rows_yet_the_classes_come_from_the_sensors_or_the_kind_else_it_says_so():
    welder_cfg = SensorsConfig(kind="welder", weld_folder="/x", label_log="/y.csv", target="tool_s")
    problems, _ = check_rules(device(rule("p:TC4"), sensors=welder_cfg), {})
    assert problems and "New, Worn, DMGD" in problems[0] and "[sensors] target = 'tool_s'" in problems[0]
    problems, _ = check_rules(device(rule("p:TC4"), kind="printer"), {})
    assert problems and 'kind = "printer"' in problems[0]
    problems, note = check_rules(device(rule("p:TC9"), kind="welder"), {})  # nothing tells the classes yet
    assert problems == [] and note is not None and "TC9" in note and "not checked" in note


def test_a_class_meaning_for_a_class_the_device_has_not_is_refused():
    problems, _ = check_rules(device(classes={"TC5": "very worn"}), {"classes": TOOL_M})
    assert problems == ["serve.classes.TC5: 'TC5' is not a class of this device (its classes are "
                        "TC1, TC2, TC3, TC4, from the dataset's metadata)"]  # fmt: skip
    assert check_rules(device(classes={"TC4": "worn horn and worn anvil"}), {"classes": TOOL_M}) == ([], None)


def test_a_rule_for_a_task_the_device_does_not_run_is_one_config_error():
    raw = {"device": "w1", "tasks": ["tool"], "serve": {"alerts": [
        {"name": "tol_worn", "task": "tol", "value": "p:TC4", "above": 0.8}]}}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        build(DeviceConfig, raw, "device.toml")
    assert "task = 'tol' is not one of the tasks here (tool)" in str(err.value)
    bad = {"device": "w1", "serve": {"alerts": [{"name": "r", "task": "tool", "value": "p:TC4", "above": 0.8,
                                                 "action": ""}], "classes": {"TC4": 3}}}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        build(DeviceConfig, bad, "device.toml")
    assert "action must be 1 to 200 characters" in str(err.value)


def test_edge_trainer_refuses_a_rule_naming_a_class_its_data_has_not_in_one_line(tmp_path):
    state = tmp_path / "state"
    x, y = np.zeros((4, 2), np.float32), np.zeros((4,), np.int64)
    save_dataset(state, Dataset(x, y), Dataset(x, y), {"source": "simulate-welder", "classes": TOOL_M})
    toml = tmp_path / "device.toml"
    toml.write_text('fleet = "plant"\nbroker = "mqtt://127.0.0.1:9"\nallow_plaintext = true\nkind = "welder"\n'
                    '[[serve.alerts]]\nname = "worn_tool"\ntask = "tool"\nvalue = "p:TC9"\nabove = 0.8\n')  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "edge.cli", "--device", "w1", "--config", str(toml), "--state-dir", str(state)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("edge-trainer: ") and "'TC9' is not one of task tool's classes" in last, out.stderr
    assert "Traceback" not in out.stderr


# -- the operator's words -----------------------------------------------------------------
def test_the_action_and_the_class_meaning_ride_on_the_event_and_the_open_alert(tmp_path):
    alerts = Alerts("w1", [rule(**WORDS)], tmp_path, {"TC4": "worn horn and worn anvil"})
    assert feed(alerts, [0.9]) == [(0, "raised")]
    (opened,) = alerts.status()
    assert opened["action"] == "replace the horn" and opened["meaning"] == "worn horn and worn anvil"
    # An alert opened before a restart takes today's words.
    again = Alerts("w1", [rule(action="replace the anvil")], tmp_path)
    assert again.status()[0]["action"] == "replace the anvil" and again.status()[0]["meaning"] is None


def test_home_assistant_names_the_alert_by_its_action_and_shows_the_message_as_attributes(tmp_path):
    published: list = []
    srv = welder(tmp_path, published)
    srv.cfg = ServeConfig(
        home_assistant=True, alerts=[rule(**WORDS)], classes={"TC4": "worn horn and worn anvil"}
    )
    srv.alerts = Alerts("w1", srv.cfg.alerts, srv.dir, srv.cfg.classes)
    alert = configs(srv.discovery())["homeassistant/binary_sensor/plant_w1/alert_worn_tool/config"]
    assert alert["name"] == "alert worn_tool: replace the horn"
    assert alert["json_attributes_topic"] == alert["state_topic"]
    srv.answer(Row("weld", "w0", 1.0, (0.0, 3.0)))
    event = json.loads(next(p for t, p in published if t == alert["state_topic"]))
    assert event["action"] == "replace the horn" and event["meaning"] == "worn horn and worn anvil"
    assert render(alert["value_template"], json.dumps(event).encode()) == "raised"


def test_the_status_says_which_rule_cannot_fire_yet_and_why(tmp_path):
    srv = welder(tmp_path, [])
    other = AlertRule(name="other", task="tool2", value="p:TC4", above=0.5)
    srv.cfg = ServeConfig(alerts=[rule(**WORDS), other])
    rules = srv.status()["rules"]
    assert rules["worn_tool"]["silent"] is None and rules["worn_tool"]["action"] == "replace the horn"
    assert rules["other"]["silent"] == "task tool2 has no serving model yet"
    # Its model comes, and does not answer TC4: the rule never fires (checked late: no rows at start).
    srv.models["tool2"] = ServingModel("w1", "tool2", WELD_SPEC, 1, linear_2x2(), {}, width=2,
                                       classes=["New", "Worn"], metric=1.0, reference=1.0)  # fmt: skip
    assert "'TC4' is not one of task tool2's classes (New, Worn)" in srv.status()["rules"]["other"]["silent"]


def test_a_moonraker_that_fails_after_the_answer_went_out_gets_the_status_republished(tmp_path):
    srv = moonraker_server(tmp_path, [], False, "http://127.0.0.1:9")  # nothing listens: refused
    srv.take_changed()
    assert srv.take_changed() is False
    assert srv.moonraker is not None
    srv.moonraker.apply("x.gcode#1", 40.0)  # on its worker thread: fails after its retries
    wait_for(lambda: srv.moonraker.failed >= 1, "the failed send")
    assert srv.take_changed() is True  # the daemon's loop publishes the status with the failure
    assert "Connection refused" in srv.status()["moonraker"]["last_error"]
    srv.close()


def test_a_rule_its_tasks_model_shows_never_fires_leaves_home_assistant(tmp_path):
    published: list = []
    srv = welder(tmp_path, published)  # tool answers TC1 / TC4
    topic = topics.topic_discovery("plant", "w1", "binary_sensor", "alert_worn_tool")
    assert dict(srv.discovery())[topic]
    srv.cfg = ServeConfig(home_assistant=True, alerts=[rule("p:TC9")])  # checked late: no rows at start
    assert dict(srv.discovery())[topic] == b""  # an empty retained config: Home Assistant removes it

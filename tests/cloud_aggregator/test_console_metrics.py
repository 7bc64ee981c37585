"""The console's /metrics scraped over HTTP from a real ``cloud-aggregator console`` on a real
mosquitto and a store written by ``SqliteStore``; the Grafana dashboard asks only for what it exports."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_aggregator.console import cli as console
from cloud_aggregator.console.fleet_view import DeviceFigures, FleetView, StoreData
from cloud_aggregator.local.broker import free_port, start_mosquitto
from cloud_aggregator.rounds.types import Reason, RoundRecord
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import topics
from tests.conftest import _require_mosquitto

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ioft.json"
CONSOLE_DOC = Path(__file__).resolve().parents[2] / "docs" / "console.md"
FLEET = "metrics"
#: Every field a device's status may carry that the metrics read.
STATUS = {
    "device": "printer1",
    "state": "online",
    "time": 1_700_000_000.0,
    "kind": "printer",
    "tasks": {"speed": {"round": 2, "metrics": {"test_loss": 0.5}}},
    "models": {"encoder": {"active": 3}},
    "refused": {"weld": "the task's model takes 624 input features per row"},
    "data": {"train": 45, "test": 135, "sensor": {"state": "fault", "running": True}},
    "process": {"cpu_s_round": 0.012, "cpu_s_total": 3.0, "max_rss_bytes": 60_000_000},
    "paused": "maintenance until Friday",
    "serving": {
        "enabled": True,
        "answered": {"speed": 7},
        "refused": {"speed": {"width": 2}},
        "models": {"speed": {"round": 2, "digest": "d" * 12}},
        "field": {
            "speed": {"metric": "error", "value": 3.5, "n": 7, "scored": 7, "reference": 3.0, "drift": False}
        },
        "advice": {"speed": {"speed": 62.0, "vibration_budget": 0.8}},
        "moonraker": {
            "sent": 3,
            "failed": 1,
            "restored": 2,
            "readback_mismatch": 0,
            "dropped": 0,
            "refused": None,
        },
        "alerts": [],
    },
}
#: A welder at work: its serving block, its latest answer (retained) and an open alert.
WELDER = {
    "device": "welder1",
    "state": "online",
    "time": 1_700_000_000.0,
    "kind": "welder",
    "serving": {
        "enabled": True,
        "field": {
            "tool": {
                "metric": "accuracy",
                "value": 0.6,
                "n": 20,
                "scored": 20,
                "reference": 0.9,
                "drift": True,
            }
        },
        "models": {"tool": {"round": 4, "digest": "e" * 12}},
    },
}
ANSWERS = {
    ("printer1", "speed"): {"key": "a.gcode#1/3", "row_time": 10.0, "answered_at": 10.1, "latency_s": 0.003,
                            "expected_speed": 70.0, "commanded": 40.0, "residual": 30.0, "model": {"round": 2}},
    ("welder1", "tool"): {"key": "weld-9", "row_time": 20.0, "answered_at": 20.1, "latency_s": 0.02, "predicted": "TC4",
                          "classes": ["TC1", "TC4"], "probabilities": [0.1, 0.9], "model": {"round": 4}},
}  # fmt: skip
ALERT = {"device": "welder1", "rule": "worn_tool", "task": "tool", "state": "raised", "at": 20.0, "key": "weld-9",
         "value": 0.9, "votes": 4, "k": 4, "n": 5, "threshold": 0.8, "since": 20.0}  # fmt: skip


def _store(state_dir: Path) -> None:
    """Two completed rounds (one closed by its deadline), one abandoned, a refusal, a rollout."""
    store = SqliteStore(state_dir / "aggregator.sqlite")
    store.register_task("speed", json.dumps({"name": "speed", "algorithm": "pflda", "rounds": 3}))
    params = {"decoder.weight": np.zeros(2, np.float32)}
    for round_, status, closed, took in (
        (1, "completed", "answered", 0.2),
        (2, "completed", "deadline", 7.0),
    ):
        rec = RoundRecord(
            "speed", round_, "train", status, ["printer1", "printer2"], {"printer1": 45, "printer2": 45},
            {"printer1": {"test_loss": 1.0 / round_}, "printer2": {"test_loss": 2.0 / round_}},
            {}, "h", 100.0, 100.0 + took, {"closed": closed},
        )  # fmt: skip
        store.save(rec, (round_ + 1, 0), params, {})
    store.save(
        RoundRecord("speed", 3, "train", "abandoned", [], {}, {}, {}, "h", 200.0, 230.0), (4, 0), params, {}
    )
    store.put_rejection("speed", 2, "printer3", Reason.REPLAY, "sent twice")
    for _ in range(2):  # copies of a counted upload: routine, apart from the refusals
        store.put_rejection("speed", 2, "printer1", Reason.RESENT, "a copy of the upload counted")
    store.put_rollout("encoder", 3, "canary", json.dumps({"model": "encoder", "version": 3}))
    store.close()


def _scrape(url: str) -> dict[str, list]:
    text = urllib.request.urlopen(url + "metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _sample_names(families: dict[str, list]) -> set[str]:
    return {s.name for samples in families.values() for s in samples}


@pytest.mark.broker
def test_metrics_endpoint_exports_what_the_dashboard_plots(tmp_path):
    _require_mosquitto()
    _store(tmp_path / "agg")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"  # $SYS byte counters every second instead of every 10
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nsys_interval 1\n")
    broker = start_mosquitto(port, config=conf, log_file=tmp_path / "mosquitto.log")
    proc = None
    try:
        pub = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        offline = {"device": "printer2", "state": "offline", "time": 1.0, "data": "garbage"}
        for body in (STATUS, offline, WELDER):
            topic = topics.topic_status(FLEET, body["device"])
            pub.publish(topic, json.dumps(body), qos=1, retain=True).wait_for_publish(5)
        for (device, task), body in ANSWERS.items():
            topic = topics.topic_answer(FLEET, device, task)
            pub.publish(topic, json.dumps(body), qos=1, retain=True).wait_for_publish(5)
        topic = topics.topic_alert(FLEET, "welder1", "worn_tool")
        pub.publish(topic, json.dumps(ALERT), qos=1, retain=True).wait_for_publish(5)
        pub.disconnect()
        pub.loop_stop()
        (tmp_path / "agg.toml").write_text(
            f'fleet = "{FLEET}"\nbroker = "{broker.url}"\nstate_dir = "{tmp_path / "agg"}"\nallow_plaintext = true\n'
        )
        proc, url = console.launch(tmp_path / "agg.toml", tmp_path / "console.log", port=0)
        deadline = time.monotonic() + 20
        while True:  # the retained statuses arrive at once, the broker's counters within a second or two
            families = _scrape(url)
            value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f}
            if (
                value.get(("ioft_broker_bytes_sent_total", ()), 0) > 0
                and ("ioft_device_online", (("device", "printer1"), ("kind", "printer"))) in value
                and ("ioft_alerts_open", (("device", "welder1"), ("rule", "worn_tool"), ("task", "tool")))
                in value
                and ("ioft_answer_expected_speed_mm_per_second", (("device", "printer1"), ("task", "speed")))
                in value
            ):
                break
            assert time.monotonic() < deadline, sorted(value)
            time.sleep(0.2)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        broker.stop()
    assert value[("ioft_rounds_total", (("status", "completed"), ("task", "speed")))] == 2
    assert value[("ioft_rounds_total", (("status", "abandoned"), ("task", "speed")))] == 1
    assert value[("ioft_round_deadline_waits_total", (("task", "speed"),))] == 1
    assert value[("ioft_round_duration_seconds_bucket", (("le", "0.25"), ("task", "speed")))] == 1
    assert value[("ioft_round_duration_seconds_count", (("task", "speed"),))] == 3
    assert value[("ioft_uploads_admitted_total", (("task", "speed"),))] == 4
    assert value[("ioft_uploads_refused_total", (("reason", "replay"), ("task", "speed")))] == 1
    assert value[("ioft_uploads_resent_total", (("task", "speed"),))] == 2
    assert ("ioft_uploads_refused_total", (("reason", "resent"), ("task", "speed"))) not in value
    assert value[("ioft_devices_online", ())] == 2
    assert value[("ioft_device_sensor_fault", (("device", "printer1"),))] == 1
    assert value[("ioft_device_round_cpu_seconds", (("device", "printer1"),))] == 0.012
    assert value[("ioft_device_max_rss_bytes", (("device", "printer1"),))] == 60_000_000
    assert value[("ioft_device_model_version", (("device", "printer1"), ("model", "encoder")))] == 3
    assert value[("ioft_device_tasks_refused", (("device", "printer1"),))] == 1
    assert value[("ioft_device_paused", (("device", "printer1"),))] == 1
    assert value[("ioft_device_paused", (("device", "printer2"),))] == 0
    assert value[("ioft_rollouts", (("state", "canary"),))] == 1
    assert ("ioft_device_rows", (("device", "printer2"), ("split", "train"))) not in value  # "garbage" data
    # The machines at work, per device and task (cloud_aggregator.console.machines_metrics).
    speed, tool = (("device", "printer1"), ("task", "speed")), (("device", "welder1"), ("task", "tool"))
    assert value[("ioft_answer_expected_speed_mm_per_second", speed)] == 70.0
    assert value[("ioft_answer_residual_mm_per_second", speed)] == 30.0
    assert value[("ioft_answer_latency_seconds", speed)] == 0.003
    assert value[("ioft_answer_probability", (("class", "TC4"), *tool))] == 0.9
    assert value[("ioft_field_error_mm_per_second", speed)] == 3.5 and value[("ioft_field_drift", speed)] == 0
    assert value[("ioft_field_accuracy", tool)] == 0.6 and value[("ioft_field_drift", tool)] == 1
    assert value[("ioft_speed_advice_mm_per_second", speed)] == 62.0
    p1 = (("device", "printer1"),)
    assert value[("ioft_moonraker_sent_total", p1)] == 3 and value[("ioft_moonraker_restored_total", p1)] == 2
    assert (
        value[("ioft_moonraker_failed_total", p1)] == 1 and value[("ioft_moonraker_apply_refused", p1)] == 0
    )
    assert ("ioft_moonraker_sent_total", (("device", "welder1"),)) not in value  # it applies nothing
    assert value[("ioft_alerts_open", (("device", "welder1"), ("rule", "worn_tool"), ("task", "tool")))] == 1
    assert value[("ioft_answers_total", speed)] == 7
    assert (
        value[
            ("ioft_answers_refused_total", (("device", "printer1"), ("reason", "width"), ("task", "speed")))
        ]
        == 2
    )

    # docs/console.md names every metric exported just now, in full (a reader greps for it).
    doc = CONSOLE_DOC.read_text()
    exported = {s.name for f in families.values() for s in f if not s.name.endswith("_created")}
    exported = {
        re.sub(r"_(bucket|count|sum)$", "", n) if n.startswith("ioft_round_duration") else n for n in exported
    }
    assert not {n for n in exported if f"`{n}`" not in doc and f"`{n}{{" not in doc}

    # Every expression of the Grafana dashboard names only metrics the endpoint exported just now.
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        used = set(re.findall(r"\bioft_[a-z_]+", expr))
        assert used, expr
        assert used <= _sample_names(families), (expr, sorted(used - _sample_names(families)))


def test_view_survives_statuses_of_any_shape():
    """A device writes its own status: wrong types give empty fields, never an exception."""
    odd = [None, 3, "x", [], {"state": 1, "data": {"train": "many", "sensor": "on"}, "process": []}]
    odd += [{"models": {"m": {"active": True}}, "refused": ["a"], "time": float("inf"), "kind": 7}]
    statuses = {f"d{i}": body for i, body in enumerate(odd)}
    view = FleetView("f", StoreData(), statuses)
    json.dumps(view.to_json(), allow_nan=False)
    figures = {f.device: f for f in view.devices()}
    assert figures["d5"] == DeviceFigures("d5", False, None, None, {}, None, {}, {}, None, None)
    assert not any(f.online for f in figures.values())

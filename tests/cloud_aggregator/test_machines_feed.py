"""The console's machines feed: answers and alert events in, a bounded view of each machine out,
and the gauges Prometheus scrapes from it (no broker: messages are fed as the session would)."""

from __future__ import annotations

import json

from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cloud_aggregator.console.machines_feed import MAX_RULES, MachineLog
from cloud_aggregator.console.machines_metrics import MachinesCollector
from cloud_aggregator.console.machines_view import machines_json
from ioft_protocol import topics
from ioft_protocol.mqtt_inbound import Message

FLEET = "plant"


def layer(i: int, expected: float = 80.0, commanded: float = 40.0) -> dict:
    return {"device": "p1", "task": "speed", "kind": "layer", "key": f"a.gcode#1/{i}", "row_time": 1000.0 + i,
            "answered_at": 1000.5 + i, "latency_s": 0.004, "model": {"task": "speed", "round": 3, "digest": "d" * 12},
            "expected_speed": expected, "commanded": commanded, "residual": expected - commanded,
            "advice": {"speed": 62.0, "vibration_budget": 0.8}}  # fmt: skip


def weld(i: int, p_worn: float) -> dict:
    rest = (1.0 - p_worn) / 3
    return {"device": "w1", "task": "tool", "kind": "weld", "key": f"weld-{i}", "row_time": 2000.0 + i,
            "answered_at": 2000.1 + i, "latency_s": 0.02, "classes": ["TC1", "TC2", "TC3", "TC4"],
            "probabilities": [rest, rest, rest, p_worn], "predicted": "TC4" if p_worn > rest else "TC1",
            "model": {"task": "tool", "round": 4, "digest": "e" * 12, "encoder": "dwt", "encoder_version": 2}}  # fmt: skip


def answer_msg(body: dict) -> Message:
    topic = topics.topic_answer(FLEET, body["device"], body["task"])
    return Message(topic, json.dumps(body).encode(), False)


def alert_msg(device: str, rule: str, state: str, at: float, since: float) -> Message:
    body = {"device": device, "rule": rule, "task": "tool", "state": state, "at": at, "key": "weld-9",
            "value": 0.93, "votes": 4, "k": 4, "n": 5, "threshold": 0.8, "since": since}  # fmt: skip
    return Message(topics.topic_alert(FLEET, device, rule), json.dumps(body).encode(), True)


def test_the_ring_keeps_the_last_answers_per_device_and_drops_repeats():
    log = MachineLog(FLEET, ring=50)
    for i in range(500):
        assert log.take(answer_msg(layer(i)))
    assert not log.take(answer_msg(layer(499)))  # the retained copy again after a reconnect
    answers, latest, _ = log.snapshot()
    assert [p.key for p in answers["p1"]] == [f"a.gcode#1/{i}" for i in range(450, 500)]
    assert latest["p1"]["speed"].key == "a.gcode#1/499" and log.taken == 500


def test_a_welds_predicted_class_reads_from_its_new_name_and_from_a_device_not_upgraded_yet():
    log = MachineLog(FLEET, ring=50)
    old = {k: v for k, v in weld(1, 0.9).items() if k != "predicted"} | {"label": "TC4"}  # not upgraded yet
    assert log.take(answer_msg(weld(0, 0.1))) and log.take(answer_msg(old))
    answers, latest, _ = log.snapshot()
    assert [a.to_json()["predicted"] for a in answers["w1"]] == ["TC1", "TC4"]
    assert "label" not in latest["w1"]["tool"].to_json()  # the page reads one name


def test_memory_is_bounded_whatever_the_fleet_sends():
    log = MachineLog(FLEET, ring=5, max_devices=3)
    for d in range(10):
        for i in range(20):
            log.take(answer_msg(layer(i) | {"device": f"p{d}", "key": f"k{i}" + "x" * 10_000}))
    for t in range(MAX_RULES + 10):  # a device inventing tasks
        log.take(answer_msg(layer(1) | {"task": f"t{t}"}))
    answers, latest, _ = log.snapshot()
    assert sorted(answers) == ["p0", "p1", "p2"] and all(len(r) == 5 for r in answers.values())
    assert all(len(p.key) <= 80 for r in answers.values() for p in r)
    assert len(latest["p0"]) <= MAX_RULES
    assert log.ignored >= 7 * 20


def test_junk_is_counted_and_ignored():
    log = MachineLog(FLEET)
    topic = topics.topic_answer(FLEET, "p1", "speed")
    for payload in (b"not json", b"[]", b'{"key": 3}', json.dumps(layer(1) | {"row_time": "soon"}).encode()):
        assert not log.take(Message(topic, payload, False))
    assert log.ignored == 4 and log.snapshot()[0] == {}
    assert log.follows(topic) and not log.follows(topics.topic_status(FLEET, "p1"))


def test_an_alert_is_open_once_raised_and_closed_once_cleared():
    log = MachineLog(FLEET)
    assert log.take(alert_msg("w1", "worn_tool", "raised", 2009.0, 2009.0))
    assert not log.take(alert_msg("w1", "worn_tool", "raised", 2009.0, 2009.0))  # the same, redelivered
    (m,) = machines_json({}, log)
    assert m["open_alerts"] == 1 and m["alerts"][0]["state"] == "raised" and m["alerts"][0]["since"] == 2009.0
    assert log.take(alert_msg("w1", "worn_tool", "cleared", 2030.0, 2009.0))
    (m,) = machines_json({}, log)
    assert m["open_alerts"] == 0 and m["alerts"][0]["state"] == "cleared"
    # A cleared retained message (the rule was removed): the rule leaves the view.
    assert log.take(Message(topics.topic_alert(FLEET, "w1", "worn_tool"), b"", True))
    assert machines_json({}, log)[0]["alerts"] == []


def test_an_alert_open_in_the_status_shows_until_a_newer_clear():
    """The status's ``alerts`` survive a restart; the console may have missed the raise message."""
    log = MachineLog(FLEET)
    raised = {
        "rule": "worn_tool",
        "task": "tool",
        "state": "raised",
        "at": 2009.0,
        "since": 2009.0,
        "key": "weld-9",
    }
    status = {"state": "online", "alerts": [raised, "junk", {"rule": 5}]}
    (m,) = machines_json({"w1": status}, log)
    assert m["open_alerts"] == 1
    log.take(alert_msg("w1", "worn_tool", "cleared", 2030.0, 2009.0))  # newer than the status's raise
    assert machines_json({"w1": status}, log)[0]["open_alerts"] == 0


def _scrape(machines: list[dict]) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MachinesCollector(lambda: machines))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def test_the_view_and_gauges_per_device_and_task():
    log = MachineLog(FLEET)
    for i in range(6):
        log.take(answer_msg(layer(i)))
        log.take(answer_msg(weld(i, 0.2 + 0.15 * i)))
    log.take(alert_msg("w1", "worn_tool", "raised", 2005.0, 2005.0))
    serving = {"enabled": True, "answered": {"tool": 6}, "refused": {"tool": {"schema": 2}, "*": {"bad_row": 1}},
               "models": {"tool": {"round": 4, "digest": "e" * 12, "encoder": "dwt", "encoder_version": 2,
                                   "candidate": "alone", "evidence": {"rows": 7, "metric": "accuracy", "why": "best",
                                   "serves": "the alone copy trained on all 35 rows, judged by its twin trained on the older 28",
                                   "scores": {"alone": 0.9, "global": None, "personal": 0.6}}}},
               "field": {"tool": {"metric": "accuracy", "value": 0.5, "n": 10, "scored": 10, "reference": 0.9,
                                  "drift": True, "awaiting_labels": 3,
                                  "coverage": {"level": 0.9, "value": 0.875, "n": 8, "all": 0.9, "scored": 20}}}}  # fmt: skip
    statuses = {"w1": {"state": "online", "kind": "welder", "serving": serving}, "p1": {"state": "offline"}}
    p1, w1 = machines_json(statuses, log)
    (tool,) = w1["tasks"]
    assert (
        tool["timeline"]["classes"] == ["TC1", "TC2", "TC3", "TC4"] and len(tool["timeline"]["points"]) == 6
    )
    assert tool["timeline"]["points"][-1][5] == 0.2 + 0.15 * 5  # [row_time, key, P(TC1)..P(TC4)]
    assert tool["field"]["drift"] is True and tool["model"]["encoder_version"] == 2
    assert (
        tool["field"]["coverage_value"],
        tool["field"]["coverage_level"],
        tool["field"]["coverage_n"],
    ) == (0.875, 0.9, 8)
    assert w1["refused_rows"] == {"bad_row": 1}
    assert tool["model"]["candidate"] == "alone" and tool["evidence"]["rows"] == 7
    assert list(tool["evidence"]["scores"].items()) == [("personal", 0.6), ("global", None), ("alone", 0.9)]
    assert "judged by its twin" in tool["evidence"]["serves"]  # which copy of alone serves
    (speed,) = p1["tasks"]
    assert speed["model"]["round"] == 3  # no serving block: the answer names its model
    assert speed["timeline"]["points"][0][2:] == [80.0, 40.0]
    json.dumps([p1, w1], allow_nan=False)

    value = _scrape([p1, w1])
    assert value[("ioft_answer_expected_speed_mm_per_second", (("device", "p1"), ("task", "speed")))] == 80.0
    assert value[("ioft_answer_residual_mm_per_second", (("device", "p1"), ("task", "speed")))] == 40.0
    assert value[("ioft_speed_advice_mm_per_second", (("device", "p1"), ("task", "speed")))] == 62.0
    assert value[("ioft_answer_latency_seconds", (("device", "p1"), ("task", "speed")))] == 0.004
    assert value[("ioft_answer_probability", (("class", "TC4"), ("device", "w1"), ("task", "tool")))] == 0.95
    assert value[("ioft_field_accuracy", (("device", "w1"), ("task", "tool")))] == 0.5
    assert value[("ioft_field_drift", (("device", "w1"), ("task", "tool")))] == 1.0
    assert value[("ioft_field_coverage", (("device", "w1"), ("task", "tool")))] == 0.875
    assert value[("ioft_field_reference_accuracy", (("device", "w1"), ("task", "tool")))] == 0.9
    assert value[("ioft_alerts_open", (("device", "w1"), ("rule", "worn_tool"), ("task", "tool")))] == 1
    assert (
        value[("ioft_answers_refused_total", (("device", "w1"), ("reason", "schema"), ("task", "tool")))] == 2
    )
    assert value[("ioft_serving_model_round", (("device", "w1"), ("task", "tool")))] == 4
    tool_of = (("device", "w1"), ("task", "tool"))
    assert value[("ioft_serving_candidate", (("candidate", "alone"), *tool_of))] == 1.0
    assert value[("ioft_serving_candidate", (("candidate", "personal"), *tool_of))] == 0.0
    assert value[("ioft_serving_candidate_score", (("candidate", "alone"), *tool_of))] == 0.9
    assert ("ioft_serving_candidate_score", (("candidate", "global"), *tool_of)) not in value
    assert value[("ioft_serving_judged_rows", tool_of)] == 7


def test_what_a_device_counts_is_a_counter_that_starts_again_when_its_trainer_restarts():
    """``_total`` counters with the device's own count and a ``_created`` of when it began counting:
    Prometheus' counter reset, which ``rate`` and ``increase`` carry over (no offset kept here)."""
    serving = {"enabled": True, "models": {"speed": {"round": 3}}, "answered": {"speed": 500}, "refused": {"speed": {"width": 3}},
               "counting_since": 1000.0, "moonraker": {"sent": 40, "failed": 1, "restored": 2, "refused": None}}  # fmt: skip
    before = _scrape(machines_json({"p1": {"state": "online", "serving": serving}}, MachineLog(FLEET)))
    restarted = serving | {"answered": {"speed": 2}, "refused": {}, "counting_since": 5000.0,
                           "moonraker": {"sent": 1, "failed": 0, "restored": 0, "refused": None}}  # fmt: skip
    after = _scrape(machines_json({"p1": {"state": "online", "serving": restarted}}, MachineLog(FLEET)))
    speed, p1 = (("device", "p1"), ("task", "speed")), (("device", "p1"),)
    assert (before[("ioft_answers_total", speed)], before[("ioft_answers_created", speed)]) == (500, 1000.0)
    assert (after[("ioft_answers_total", speed)], after[("ioft_answers_created", speed)]) == (2, 5000.0)
    assert before[("ioft_answers_refused_created", (*speed[:1], ("reason", "width"), speed[1]))] == 1000.0
    for k in ("sent", "failed", "restored"):  # Moonraker's counts, with the same _created
        assert (
            before[(f"ioft_moonraker_{k}_created", p1)] == 1000.0
            and (f"ioft_moonraker_{k}_total", p1) in after
        )
    assert ("ioft_answers", speed) not in before  # no gauge of the same count beside it

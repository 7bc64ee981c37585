"""What the operator reads about alerts, without a broker: ``fleet status`` lists the open alerts with
what to do and the rules that cannot fire; the console's machines view carries the same words, a
failing Moonraker, a model with no reference to drift from, and "seen" from the latest answer."""

from __future__ import annotations

import json

from cloud_aggregator.console.fleet_status import alert_lines
from cloud_aggregator.console.machines_feed import MachineLog
from cloud_aggregator.console.machines_view import machines_json
from ioft_protocol import topics
from ioft_protocol.mqtt_inbound import Message
from tests.cloud_aggregator.test_machines_feed import FLEET, answer_msg, weld

RAISED = {"rule": "worn_tool", "task": "tool", "state": "raised", "at": 2009.0, "since": 2009.0, "key": "weld-9",
          "value": 0.93, "votes": 4, "k": 4, "n": 5, "threshold": 0.8, "action": "replace the horn",
          "meaning": "worn horn and worn anvil"}  # fmt: skip
RULES = {
    "worn_tool": {"task": "tool", "value": "p:TC4", "above": 0.8, "action": "replace the horn",
                  "meaning": "worn horn and worn anvil", "silent": None},
    "tool2_worn": {"task": "tool2", "value": "p:TC4", "above": 0.5, "action": None, "meaning": None,
                   "silent": "task tool2 has no serving model yet"},
}  # fmt: skip
SERVING = {"enabled": True, "rules": RULES, "classes": {"TC4": "worn horn and worn anvil", "TC1": 5}}
STATUS = {"state": "online", "time": 1000.0, "alerts": [RAISED], "serving": SERVING}


def test_fleet_status_lists_each_open_alert_with_what_to_do_and_each_rule_that_cannot_fire():
    opened, silent = alert_lines({"w1": STATUS, "p1": {"state": "online"}, "x": "junk"}, now=2069.0)
    (line,) = opened
    assert line.startswith("w1: worn_tool (task tool — worn horn and worn anvil) open since ")
    assert "(60 s ago): 4 of the last 5 over 0.8; what to do: replace the horn" in line
    assert silent == ["w1: rule tool2_worn cannot fire: task tool2 has no serving model yet"]
    junk = {"w1": {"alerts": [{"rule": "\x1b[2J", "since": "x"}], "serving": {"rules": {"r": {"silent": 3}}}}}
    assert alert_lines(junk, now=0.0) == (["w1: ?[2J (task ?) open since ?: ? of the last ? over ?"], [])


def test_the_machines_view_carries_the_words_moonraker_failures_references_and_seen():
    log = MachineLog(FLEET)
    log.take(answer_msg(weld(1, 0.9)))  # answered at 2001.1, long after the status of t = 1000
    body = {"device": "w1", "rule": "worn_tool", **RAISED}
    log.take(Message(topics.topic_alert(FLEET, "w1", "worn_tool"), json.dumps(body).encode(), True))
    serving = STATUS["serving"] | {
        "models": {"tool": {"round": 4, "reference": None}},
        "moonraker": {"sent": 0, "failed": 2, "last_error": "SET_VELOCITY_LIMIT: connection refused"},
    }
    (m,) = machines_json({"w1": STATUS | {"serving": serving}}, log)
    assert m["last_seen"] == 2001.1  # its latest answer, not its status
    (alert,) = m["alerts"]
    assert (alert["action"], alert["meaning"]) == ("replace the horn", "worn horn and worn anvil")
    assert [r["rule"] for r in m["rules"] if r["silent"]] == ["tool2_worn"]
    assert m["classes"] == {"TC4": "worn horn and worn anvil"}  # what is not words is dropped
    assert m["moonraker"]["failed"] == 2 and "connection refused" in m["moonraker"]["last_error"]
    (task,) = m["tasks"]
    assert task["model"]["round"] == 4 and task["model"]["reference"] is None

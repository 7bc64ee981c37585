"""A retained "online" status with nothing live behind it stalls no round (issue 32 §5).

A client published ``state = online`` retained for ``ghost1`` and left without a will: before, every
round of a task waiting for "whoever is online" waited out its deadline for it (1 round in 20 s
against 850).  Now rounds wait only for devices heard live (a heartbeat or an answer to the
aggregator's roll call, not the retained copy) and name the ones they skipped, in the round's record
and in one log line.  Real mosquitto, real ``edge-trainer`` and ``serve`` processes.
"""

from __future__ import annotations

import json

import paho.mqtt.client as paho
import pytest

from cloud_aggregator.local.fleet import FLEET, aggregator_toml, pflda_task
from ioft_protocol import topics

pytestmark = pytest.mark.broker
#: Guards against a hung test only; nothing here is a timing assertion.
PATIENCE_S = 120.0
DEVICES = ("printer1", "printer2")
GHOST = "ghost1"
ROUNDS = 3


def publish_ghost(port: int) -> None:
    """A retained "online" status for ``GHOST`` from a client that leaves cleanly: no will, no heartbeat."""
    client = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, client_id="ghost-maker")
    client.connect("127.0.0.1", port)
    client.loop_start()
    body = {
        "device": GHOST,
        "state": "online",
        "kind": "printer",
        "tags": [],
        "data": {"train": 50, "test": 10},
    }
    client.publish(
        topics.topic_status(FLEET, GHOST), json.dumps(body).encode(), qos=1, retain=True
    ).wait_for_publish(10)
    client.disconnect()
    client.loop_stop()


def test_rounds_skip_a_retained_online_status_that_nothing_answers_for(fleet_procs, mosquitto):
    publish_ghost(mosquitto.port)
    fleet_procs.start_devices(DEVICES, "--log-level", "WARNING")
    fleet_procs.start_aggregator(
        aggregator_toml(
            fleet_procs.broker_url,
            fleet_procs.work / "aggregator",
            [pflda_task(rounds=ROUNDS)],
            expected=[],  # whoever is online
            min_participants=2,
            deadline_s=60.0,  # waited out only if the ghost were awaited
            max_extensions=0,
        )
    )
    fleet_procs.wait_for(
        lambda: (
            fleet_procs.aggregator.poll() is not None
            or any(r.extra.get("closed") == "deadline" for r in fleet_procs.rounds())
        ),
        PATIENCE_S,
        f"the task's {ROUNDS} rounds done (or a round that waited out its deadline)",
    )
    records = fleet_procs.rounds()
    text = fleet_procs.log("aggregator")
    for r in records:  # no round waited for the ghost; each names it as skipped
        assert r.status == "completed" and r.extra.get("closed") == "answered", (r, text[-4000:])
        assert sorted(r.participants) == list(DEVICES), r
        assert list(r.extra.get("skipped", {})) == [GHOST], r.extra
        assert "retained" in r.extra["skipped"][GHOST], r.extra
    assert {r.round for r in records} == set(range(1, ROUNDS + 1)), records
    assert fleet_procs.aggregator.poll() == 0, text[-4000:]
    said = [ln for ln in text.splitlines() if "not waiting for" in ln]
    assert len(said) == 1 and GHOST in said[0] and "liveness_s" in said[0], text[-4000:]
    assert "Traceback" not in text, text[-4000:]


def test_a_device_heard_only_by_its_heartbeat_stays_awaited(fleet_procs):
    """Rounds that span several ``liveness_s``: each answer leaves 1.5 s after its announcement
    (``[simulate] update_s``), and after its first round a device's status goes out only every
    ``round_status_s`` (30 s).  Its heartbeat (``heartbeat_s``) keeps it live, so every round starts
    awaiting both devices and closes on their answers; without it (``heartbeat_s = 0``) they fall
    silent for the aggregator, and a round starts without them, naming them as not live."""
    toml = fleet_procs.work / "device.toml"
    toml.write_text("heartbeat_s = 0.5\n\n[simulate]\nupdate_s = 1.5\n")
    fleet_procs.start_devices(DEVICES, "--config", str(toml), "--log-level", "WARNING")
    text = aggregator_toml(
        fleet_procs.broker_url,
        fleet_procs.work / "aggregator",
        [pflda_task(rounds=ROUNDS + 3)],
        expected=[],
        min_participants=2,
        deadline_s=60.0,
        max_extensions=0,
    )
    fleet_procs.start_aggregator(text.replace("[collect]\n", "[collect]\nliveness_s = 4.0\n"))
    fleet_procs.wait_for(
        lambda: (
            fleet_procs.aggregator.poll() is not None
            or any(r.extra.get("closed") == "deadline" for r in fleet_procs.rounds())
        ),
        PATIENCE_S,
        "the task's rounds done (or a round that waited out its deadline)",
    )
    text = fleet_procs.log("aggregator")
    assert "not waiting for" not in text, text[-4000:]  # no round started without them
    for r in fleet_procs.rounds():
        assert r.status == "completed" and r.extra.get("closed") == "answered", (r, text[-4000:])
        assert sorted(r.participants) == list(DEVICES) and "skipped" not in r.extra, r
    assert len(fleet_procs.rounds()) == ROUNDS + 3 and fleet_procs.aggregator.poll() == 0, text[-4000:]

"""A swarm of virtual devices (``edge-trainer --swarm N``) against a real mosquitto and ``serve``:
each device is its own MQTT client with its own retained status and Last Will, running the
daemon's round logic; one process, one network loop."""

from __future__ import annotations

import json
import signal
import threading
import time

import paho.mqtt.client as paho
import pytest

from cloud_aggregator.local.fleet import FLEET, aggregator_toml
from ioft_protocol import topics

N = 50


def statuses(broker_url: str, want: int, timeout: float = 30.0) -> dict[str, dict]:
    """The retained statuses on the broker, once ``want`` devices have one (or ``timeout``)."""
    host, port = broker_url.removeprefix("mqtt://").split(":")
    got: dict[str, dict] = {}
    enough = threading.Event()

    def on_message(client, userdata, msg):
        got[msg.topic.split("/")[-1]] = json.loads(msg.payload)
        if len(got) >= want:
            enough.set()

    c = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2)
    c.on_message = on_message
    c.connect(host, int(port))
    c.subscribe(topics.topic_status_all(FLEET), qos=1)
    c.loop_start()
    try:
        enough.wait(timeout)
        time.sleep(0.3)  # the rest of the retained burst
    finally:
        c.loop_stop()
        c.disconnect()
    return dict(got)


@pytest.mark.broker
def test_swarm_of_50_devices_completes_rounds_with_serve(fleet_procs):
    names = [f"dev{i:05d}" for i in range(N)]
    swarm = fleet_procs.start_device("dev", "--swarm", str(N), "--log-level", "WARNING", simulate="printer")
    task = {
        "name": "bench",
        "algorithm": "echo",
        "model": "vector",
        "rounds": 3,
        "model_args": {"size": 1000},
    }
    toml = aggregator_toml(
        fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=names, deadline_s=60
    )
    fleet_procs.start_aggregator(toml, log_level="WARNING")
    assert fleet_procs.wait_aggregator(180) == 0, fleet_procs.log("aggregator")[-3000:]
    records = fleet_procs.rounds("bench")
    assert [r.status for r in records] == ["completed"] * 3
    assert all(sorted(r.participants) == names for r in records)
    assert all(r.extra.get("closed") == "answered" for r in records)  # nobody waited for a deadline
    # A round's status goes out at most every round_status_s; the task's "done" sends the last one.
    deadline = time.monotonic() + 20
    while True:
        online = statuses(fleet_procs.broker_url, N)
        if time.monotonic() > deadline or all(s["tasks"]["bench"]["round"] == 3 for s in online.values()):
            break
    assert sorted(online) == names
    assert all(s["state"] == "online" and s["tasks"]["bench"]["round"] == 3 for s in online.values())
    # Every device's state file is its own, written by the daemon's code.
    assert all(
        (fleet_procs.work / "dev" / d / "tasks" / "bench" / "local.safetensors").exists() for d in names
    )
    # SIGKILL: the broker publishes each device's own Last Will (retained "offline").
    swarm.send_signal(signal.SIGKILL)
    swarm.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        gone = statuses(fleet_procs.broker_url, N, timeout=5)
        if all(s["state"] == "offline" for s in gone.values()):
            break
    assert sorted(gone) == names and {s["state"] for s in gone.values()} == {"offline"}

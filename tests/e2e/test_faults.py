"""Faults against real processes: a device killed mid-run, the broker restarted
(``checks.fault_scenarios``, which the reliability study repeats and counts), and
garbage, oversized and NaN-filled updates on the uplink.

The aggregator freezes itself at an exact step (``IOFT_FAULT=<point>:<n>:stop``) while the
scenario kills a device or the broker, then resumes it with SIGCONT: a PFL-DA round takes
tens of milliseconds, so "wait for round 2, then kill" raced the whole run to its end.
"""

from __future__ import annotations

import numpy as np
import paho.mqtt.client as paho
import pytest

from checks import fault_scenarios
from cloud_aggregator.local.fleet import FLEET, aggregator_toml, pflda_task
from ioft_protocol import round_messages, topics

DEVICES = ["printer1", "printer2", "printer3"]


@pytest.mark.broker
@pytest.mark.any_broker
def test_round_completes_without_a_device_killed_mid_run(fleet_procs):
    run = fault_scenarios.device_killed(fleet_procs)
    records = run.records
    assert [r.status for r in records] == ["completed"] * 5
    assert [sorted(r.participants) for r in records[2:]] == [["printer1", "printer2"]] * 3
    # The rounds without printer3 waited for it until the deadline, then closed without it.
    for r in records[2:]:
        assert 2.0 <= r.finished - r.started < 2.0 * 6 + 10
    assert (run.on_wire, run.counted, run.lost) == (12, 12, 0)


@pytest.mark.broker
def test_training_survives_a_broker_restart(fleet_procs, mosquitto):
    run = fault_scenarios.broker_restart(fleet_procs, mosquitto)
    records = run.records
    assert [r.round for r in records] == list(range(1, 9))
    assert all(r.status == "completed" for r in records)
    assert all(r.finished > run.extras["killed_at"] for r in records[3:])  # round 4 on ran after the restart
    # Every device reconnected and answered every round, round 4 included (re-announced on reconnect).
    assert all(sorted(r.participants) == DEVICES for r in records)
    assert run.extras["devices_alive"]
    assert (run.counted, run.lost) == (24, 0)


class Attacker:
    """Publishes hostile uplinks for whatever round is announced."""

    def __init__(self, url: str, max_payload: int) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.max_payload = max_payload
        self.sent: list[str] = []
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311
        )
        self.client.on_connect = lambda c, *a: c.subscribe(topics.topic_down(FLEET, "speed"), qos=1)
        self.client.on_message = self._on_announcement
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on_announcement(self, client, userdata, msg) -> None:
        ann = round_messages.Announcement.decode(bytes(msg.payload))
        if ann.state != "running" or ann.round in {int(s.split(":")[1]) for s in self.sent}:
            return
        up = lambda dev: topics.topic_up(FLEET, "speed", dev)  # noqa: E731
        nan = {k: np.full_like(v, np.nan) for k, v in ann.params.items()}
        msg_nan = round_messages.UpdateMessage(
            FLEET, "speed", "printer1", ann.round, ann.phase, 10, ann.global_hash, {}, nan
        )
        wrong_shape = {k: np.zeros((3, 3), np.float32) for k in ann.params}
        msg_shape = round_messages.UpdateMessage(
            FLEET, "speed", "printer2", ann.round, ann.phase, 10, ann.global_hash, {}, wrong_shape
        )
        spoof = round_messages.UpdateMessage(
            FLEET, "speed", "printer1", ann.round, ann.phase, 10, ann.global_hash, {}, ann.params
        )
        client.publish(up("printer1"), b"\x00garbage\xff" * 5, qos=1)
        client.publish(up("printer2"), b"x" * (self.max_payload + 1), qos=1)
        client.publish(up("printer1"), msg_nan.encode(), qos=1)
        client.publish(up("printer2"), msg_shape.encode(), qos=1)
        client.publish(up("printer3"), spoof.encode(), qos=1)  # printer1's name inside printer3's topic
        self.sent.append(f"round:{ann.round}")

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.broker
@pytest.mark.any_broker
def test_hostile_uplinks_are_dropped_and_training_continues(fleet_procs):
    from cloud_aggregator.store.sqlite import SqliteStore

    task = pflda_task(rounds=4)
    attacker = Attacker(fleet_procs.broker_url, max_payload=64 * 1024)
    try:
        for d in DEVICES:
            fleet_procs.start_device(d)
        toml = aggregator_toml(
            fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES
        )
        fleet_procs.start_aggregator(
            toml.replace("allow_plaintext = true", "allow_plaintext = true\nmax_payload_bytes = 65536")
        )
        assert fleet_procs.wait_aggregator(90) == 0
    finally:
        attacker.stop()
    records = fleet_procs.rounds()
    assert [r.status for r in records] == ["completed"] * 4
    assert all(sorted(r.participants) == DEVICES for r in records)  # real updates still counted
    store = SqliteStore(fleet_procs.db)
    counts = store.rejection_counts("speed")
    final = store.get_params(records[-1].global_hash)
    store.close()
    assert all(np.isfinite(v).all() for v in final.values())
    assert len(attacker.sent) >= 3
    assert counts.get("printer1", 0) >= 2 * len(attacker.sent) - 1  # garbage + NaN each round
    assert counts.get("printer2", 0) >= 2 * len(attacker.sent) - 1  # oversized + wrong shape
    assert counts.get("printer3", 0) >= len(attacker.sent) - 1  # spoofed identity
    log = fleet_procs.log("aggregator")
    for reason in (
        "exceeds the limit",
        "malformed payload",
        "NaN or Inf",
        "claims to be from",
        "expected float32",
    ):
        assert reason in log, reason

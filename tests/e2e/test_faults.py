"""Faults against real processes: a device killed mid-run, the broker restarted,
and garbage, oversized and NaN-filled updates on the uplink."""

from __future__ import annotations

import signal
import time

import numpy as np
import paho.mqtt.client as paho
import pytest

from cloud_aggregator.broker import start_mosquitto
from edge import wire
from tests.e2e.fleet import FLEET, PFLDA_TASK, aggregator_toml

DEVICES = ["printer1", "printer2", "printer3"]


@pytest.mark.broker
def test_round_completes_without_a_device_killed_mid_run(fleet_procs):
    task = {**PFLDA_TASK, "rounds": 5}
    for d in DEVICES:
        fleet_procs.start_device(d)
    fleet_procs.start_aggregator(
        aggregator_toml(
            fleet_procs.broker_url,
            fleet_procs.work / "aggregator",
            [task],
            expected=DEVICES,
            deadline_s=2.0,
            min_participants=2,
        )
    )
    fleet_procs.wait_for(lambda: len(fleet_procs.rounds()) >= 2, 60, "two rounds")
    fleet_procs.devices["printer3"].send_signal(signal.SIGKILL)
    assert fleet_procs.wait_aggregator(60) == 0
    records = fleet_procs.rounds()
    assert [r.status for r in records] == ["completed"] * 5
    assert sorted(records[-1].participants) == ["printer1", "printer2"]
    # The rounds without printer3 waited for the deadline, no longer.
    assert records[-1].finished - records[-1].started < 10


@pytest.mark.broker
def test_training_survives_a_broker_restart(fleet_procs, mosquitto, tmp_path):
    task = {**PFLDA_TASK, "rounds": 8}
    for d in DEVICES:
        fleet_procs.start_device(d)
    fleet_procs.start_aggregator(
        aggregator_toml(
            fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES, deadline_s=30
        )
    )
    fleet_procs.wait_for(lambda: len(fleet_procs.rounds()) >= 3, 60, "three rounds")
    mosquitto.kill()
    killed_at = time.time()
    done_before = len(fleet_procs.rounds())
    time.sleep(1.5)
    restarted = start_mosquitto(mosquitto.port, log_file=tmp_path / "mosquitto2.log")
    try:
        assert fleet_procs.wait_aggregator(90) == 0, fleet_procs.log("aggregator")[-3000:]
    finally:
        restarted.stop()
    records = fleet_procs.rounds()
    assert done_before < 8, "the broker must go away mid-run"
    assert [r.round for r in records] == list(range(1, 9))
    assert all(r.status == "completed" for r in records)
    assert sum(r.finished > killed_at + 1.5 for r in records) >= 8 - done_before - 1
    # Every device rejoined: the last round has all three.
    assert sorted(records[-1].participants) == DEVICES
    assert all(p.poll() is None for p in fleet_procs.devices.values())


class Attacker:
    """Publishes hostile uplinks for whatever round is announced."""

    def __init__(self, url: str, max_payload: int) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.max_payload = max_payload
        self.sent: list[str] = []
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311
        )
        self.client.on_connect = lambda c, *a: c.subscribe(wire.topic_down(FLEET, "speed"), qos=1)
        self.client.on_message = self._on_announcement
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on_announcement(self, client, userdata, msg) -> None:
        ann = wire.Announcement.decode(bytes(msg.payload))
        if ann.state != "running" or ann.round in {int(s.split(":")[1]) for s in self.sent}:
            return
        up = lambda dev: wire.topic_up(FLEET, "speed", dev)  # noqa: E731
        nan = {k: np.full_like(v, np.nan) for k, v in ann.params.items()}
        msg_nan = wire.UpdateMessage(
            FLEET, "speed", "printer1", ann.round, ann.phase, 10, ann.global_hash, {}, nan
        )
        wrong_shape = {k: np.zeros((3, 3), np.float32) for k in ann.params}
        msg_shape = wire.UpdateMessage(
            FLEET, "speed", "printer2", ann.round, ann.phase, 10, ann.global_hash, {}, wrong_shape
        )
        spoof = wire.UpdateMessage(
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
def test_hostile_uplinks_are_dropped_and_training_continues(fleet_procs):
    from cloud_aggregator.store import SqliteStore

    task = {**PFLDA_TASK, "rounds": 4}
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

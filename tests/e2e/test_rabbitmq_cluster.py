"""A fleet on a two-node RabbitMQ cluster on loopback: the devices on node A,
``cloud-aggregator serve`` on node B.

RabbitMQ 3.10 keeps a retained message on the node it was published through and hands it only to
subscriptions on exactly its topic, so the aggregator (``status/+``) never receives the devices'
retained statuses, and a device (``task/+/down``) that connects after a round was announced never
receives the announcement.  The rounds complete through ``ioft_protocol.restate``: the roll call
(the aggregator, started after the devices, asks them for their statuses) and the re-announcement
to a new connection (the late device gets the round on its own downlink).  The same run on
mosquitto checks that a device given the round both ways answers it once.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator

import paho.mqtt.client as paho
import pytest

from cloud_aggregator.local.fleet import FLEET, LocalFleet, aggregator_toml, pflda_task
from cloud_aggregator.local.rabbitmq import RabbitCluster, start_cluster
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import BrokerAddress, MqttError, SessionOptions
from tests.conftest import _require_rabbitmq

EARLY = ["printer1", "printer2"]
LATE = "printer3"
ROUNDS = 3


class Watch:
    """A plain subscriber on one node, keeping every message it is sent live (topic, payload)."""

    def __init__(self, url: str, *filters: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.messages: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311
        )
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()
        for f in filters:
            self.client.subscribe(f, qos=1)

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload)))

    def statuses(self, device: str) -> list[dict]:
        with self._lock:
            got = [p for t, p in self.messages if t == topics.topic_status(FLEET, device)]
        return [json.loads(p) for p in got if p]

    def seen(self, topic: str) -> bool:
        with self._lock:
            return any(t == topic for t, _ in self.messages)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[RabbitCluster]:
    _require_rabbitmq()
    with start_cluster(tmp_path_factory.mktemp("cluster"), 2) as c:
        yield c


def late_device_run(tmp_path, devices_url: str, aggregator_url: str) -> tuple[list, LocalFleet]:
    """The early devices up, then the aggregator, then the late device after round 1 was announced;
    a device killed at the end must be seen offline where the aggregator is.  The rounds, and the fleet."""
    fleet = LocalFleet(tmp_path, devices_url)
    status_all = topics.topic_status_all(FLEET)
    on_devices = Watch(devices_url, status_all, topics.topic_down(FLEET, "speed"))
    on_aggregator = Watch(aggregator_url, status_all)
    try:
        # The devices are up, their retained statuses kept where they connect, before the aggregator starts.
        fleet.start_devices(EARLY)
        fleet.wait_for(lambda: all(on_devices.statuses(d) for d in EARLY), 60, "early devices online")
        fleet.start_aggregator(
            aggregator_toml(
                aggregator_url,
                fleet.work / "aggregator",
                [pflda_task(rounds=ROUNDS)],
                expected=[*EARLY, LATE],  # every round waits for all three...
                startup_wait_s=3.0,  # ...but the first is announced before the late one is up
                deadline_s=30.0,
            )
        )
        # The late device connects after round 1 was announced (retained where the aggregator is).
        fleet.wait_for(lambda: on_devices.seen(topics.topic_down(FLEET, "speed")), 60, "round 1 announced")
        fleet.start_device(LATE)
        assert fleet.wait_aggregator(120) == 0, fleet.log("aggregator")[-3000:]
        records = fleet.rounds()
        # A device that dies is seen offline where the aggregator is: its Last Will.
        fleet.devices["printer1"].send_signal(signal.SIGKILL)
        fleet.wait_for(
            lambda: any(s.get("state") == "offline" for s in on_aggregator.statuses("printer1")),
            30,
            "printer1's Last Will",
        )
    finally:
        fleet.stop_all()
        on_devices.stop()
        on_aggregator.stop()
    return records, fleet


def check_rounds(records: list, fleet: LocalFleet) -> None:
    assert [r.status for r in records] == ["completed"] * ROUNDS
    for r in records:
        # Every round waited for, and got, all three: none closed on its deadline.
        assert sorted(r.participants) == [*EARLY, LATE], (r.round, r.participants)
        assert r.extra.get("closed") == "answered", (r.round, r.extra)
    log = fleet.log("aggregator")
    assert "2 online at start" in log, log[-2000:]  # it learnt of the early two at once
    store = SqliteStore(fleet.db, readonly=True)
    try:
        # The late device trained and uploaded once per round: no copy answered twice (a replay).
        assert store.rejection_counts("speed") == {}
    finally:
        store.close()


@pytest.mark.broker
@pytest.mark.slow
def test_rounds_complete_with_devices_on_one_node_and_the_aggregator_on_the_other(cluster, tmp_path):
    node_a, node_b = cluster.nodes
    records, fleet = late_device_run(tmp_path, node_a.url, node_b.url)
    check_rounds(records, fleet)


@pytest.mark.broker
def test_on_mosquitto_a_late_device_answers_the_retained_round_once(mosquitto, tmp_path):
    """The same run on one mosquitto: the late device gets the round retained and again from the
    aggregator (restated to its new connection), and answers it once."""
    records, fleet = late_device_run(tmp_path, mosquitto.url, mosquitto.url)
    check_rounds(records, fleet)


@pytest.mark.broker
def test_a_password_login_works_on_rabbitmq_and_a_wrong_password_is_final(rabbitmq_node):
    """Fleets with ``auth = "password"`` log in with a username and password: RabbitMQ's users
    take them, and a wrong password is refused with the one line that stops the retrying."""
    rabbitmq_node.ctl("add_user", "printer9", "right-pw")
    rabbitmq_node.ctl("set_permissions", "-p", "/", "printer9", ".*", ".*", ".*")
    address = BrokerAddress.parse(rabbitmq_node.url)
    good = MqttSession(
        SessionOptions(address, "ioft-test-printer9", username="printer9", password="right-pw")
    )
    good.start(timeout=20)
    good.stop()
    bad = MqttSession(SessionOptions(address, "ioft-test-printer9", username="printer9", password="wrong"))
    with pytest.raises(MqttError, match="not retrying"):
        bad.start(timeout=20)

"""The hand-off from paho's network thread to the collecting thread: uploads that arrive while the
round is busy wait in the session's inbound FIFO and are taken in without a wake-up each, straight
to the collecting task (not through its task queue: one hop, not two), in arrival order with the
statuses between them.  A real mosquitto, a real session, a real SQLite store."""

from __future__ import annotations

import json
import threading
import time

import paho.mqtt.client as paho

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet, parse_topic
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions
from tests.cloud_aggregator.test_admission import FLEET, global_params, honest, request, upload

DEVICES = [f"d{i}" for i in range(30)]


class HeldStore(SqliteStore):
    """A store whose first write of uploads waits until ``release`` is set: the round is busy."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.busy, self.release = threading.Event(), threading.Event()

    def put_batch(self, updates, rejections) -> None:
        if not self.busy.is_set():
            self.busy.set()
            assert self.release.wait(30)
        super().put_batch(updates, rejections)


def test_uploads_arriving_while_busy_are_taken_in_one_wake_up_in_arrival_order(mosquitto, tmp_path):
    session = MqttSession(SessionOptions(BrokerAddress("127.0.0.1", mosquitto.port, False), "agg"))
    session.start()
    store = HeldStore(tmp_path / "agg.sqlite")
    fleet = MqttFleet(session, FLEET, CollectPolicy(deadline_s=30, expected=tuple(DEVICES)), store)
    handled: list[tuple[str, str]] = []
    routed: list[str] = []
    arrived: list[tuple[str, str]] = []
    handle, route, put = fleet.handle, fleet._route, session.inbound.put_nowait

    def noting_handle(msg: Message, *args, **kwargs) -> None:
        t = parse_topic(msg.topic)
        handled.append((t.kind, t.device))
        handle(msg, *args, **kwargs)

    def noting_route(msg: Message) -> None:
        routed.append(msg.topic)
        route(msg)

    def noting_put(msg: Message) -> None:  # the network thread's order
        t = parse_topic(msg.topic)
        arrived.append((t.kind, t.device))
        put(msg)

    fleet.handle, fleet._route, session.inbound.put_nowait = noting_handle, noting_route, noting_put
    g = global_params()
    req = request(1, g)
    # d0's upload first: its batch blocks in the store; everything else arrives meanwhile, each
    # upload after a status of another device (statuses and uploads interleaved).
    sent = [("up", DEVICES[0])]
    for i, d in enumerate(DEVICES[1:], 1):
        sent += [("status", f"s{i}"), ("up", d)]
    device = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="devices")
    device.connect("127.0.0.1", mosquitto.port)
    device.loop_start()
    out: list = []
    collecting = threading.Thread(target=lambda: out.extend(fleet.collect(req)))
    try:
        time.sleep(0.5)  # the aggregator's subscriptions (SUBACK) before anything is published
        collecting.start()
        acks = []
        for n, (kind, who) in enumerate(sent):
            if kind == "status":
                status = json.dumps({"state": "offline", "kind": "probe"}).encode()
                acks.append(device.publish(topics.topic_status(FLEET, who), status, qos=1))
            else:
                m = upload(req, who, honest(g, who, 1))
                acks.append(device.publish(m.topic, m.payload, qos=1))
            if n == 0:
                assert store.busy.wait(30)
        for info in acks:
            info.wait_for_publish(10)
        while session.inbound.qsize() < len(sent) - 1:  # all of it waits behind the busy round
            time.sleep(0.01)
        woken = getattr(session.inbound, "wakeups", None)
        store.release.set()
        collecting.join(30)
        assert not collecting.is_alive()
    finally:
        store.release.set()
        device.loop_stop()
        device.disconnect()
        session.stop()
        store.close()
    # Each upload went straight to its round, never through the task's queue ...
    assert routed == []
    # The whole backlog was taken in without the collecting thread going to sleep once.
    assert session.inbound.wakeups == woken
    # ... and each message was handled in the order it arrived, statuses between the uploads.
    assert sorted(handled) == sorted(sent)
    assert handled == arrived
    assert any(
        a[0] == c[0] == "up" and b[0] == "status"
        for a, b, c in zip(handled, handled[1:], handled[2:], strict=False)
    )
    assert sorted(u.device for u in out if isinstance(u, Update)) == sorted(DEVICES)

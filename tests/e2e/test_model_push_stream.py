"""A device takes a push's chunks on one subscription to the version's chunk topics, on mosquitto
and on RabbitMQ, whose MQTT plugin sends no retained message to a subscription with a wildcard:
there the stream brings nothing already published, and the device, once it goes quiet, asks for
the missing chunks on their own topics, a window at a time."""

from __future__ import annotations

import json
import os
import time

import pytest

from cloud_aggregator.local.fleet import FLEET
from cloud_aggregator.local.rabbitmq import RabbitNode
from cloud_aggregator.models.push import push_messages
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions

CHUNK = 32 * 1024
FALLBACK = "fetching the rest a window at a time"


@pytest.mark.broker
@pytest.mark.any_broker
def test_chunks_already_on_the_broker_reach_a_device_on_any_broker(fleet_procs, broker, tmp_path):
    priv, pub = generate_keypair(tmp_path / "keys" / "fleet.key")
    url = fleet_procs.broker_url
    watch = MqttSession(SessionOptions(BrokerAddress.parse(url), client_id=f"test-watch-{os.getpid()}"))
    watch.subscribe(topics.topic_status(FLEET, "printer1"))  # exact: retained on RabbitMQ too
    watch.start()
    op = MqttSession(SessionOptions(BrokerAddress.parse(url), client_id=f"test-op-{os.getpid()}"))
    op.start()
    status: dict = {}

    def wait(cond, what: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = watch.get(0.1)
            if msg is not None and msg.payload:
                status.update(json.loads(msg.payload))
            if cond():
                return
        raise AssertionError(f"timed out waiting for {what}: {status}\n{fleet_procs.log('printer1')[-2000:]}")

    try:
        fleet_procs.start_device("printer1", "--simulate", "printer-raw", "--model-key", str(pub))
        wait(lambda: status.get("state") == "online", "online")
        pkg = signed(window_encoder(tmp_path / "v1.onnx", pad_bytes=200_000), tmp_path / "pkg",
                     load_private_key(priv), version=1)  # fmt: skip
        msgs = push_messages(FLEET, pkg, chunk_size=CHUNK)
        for topic, payload in msgs[1:]:  # every chunk retained before the device hears of the push
            op.publish(topic, payload, retain=True)
        op.publish(*msgs[0], retain=True)  # then the offer, live
        wait(lambda: ((status.get("models") or {}).get("enc") or {}).get("active") == 1, "v1 active")
        last = status["models"]["enc"]["last_transfer"]
        assert last["chunks"] == len(msgs) - 1 >= 6 and last["resumed_chunks"] == 0
        installed = tmp_path / "printer1" / "models" / "enc" / "v1.onnx"
        assert installed.read_bytes() == pkg.onnx_path.read_bytes()
        # mosquitto sends the retained chunks to the stream's subscription; RabbitMQ does not.
        assert (FALLBACK in fleet_procs.log("printer1")) == isinstance(broker, RabbitNode)
    finally:
        op.stop()
        watch.stop()

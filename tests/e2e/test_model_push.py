"""Model pushes on a real fleet: mosquitto, `edge-trainer` processes, `cloud-aggregator push / fleet status`.

The encoders are real ONNX files run by onnxruntime on the devices (built with
``onnx.helper``, so this path needs no torch), signed with a real Ed25519 fleet key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import paho.mqtt.client as paho
import pytest

from cloud_aggregator.local.fleet import FLEET, aggregator_toml
from cloud_aggregator.local.rabbitmq import RabbitNode
from cloud_aggregator.models.push import push_messages, push_model
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from ioft_protocol import model_push, round_messages, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions
from sensors.features.schema import schema_hash

DEVICES = ["printer1", "printer2", "printer3"]
CHUNK = 32 * 1024
HEAD_TASK = {
    "name": "speed-raw",
    "algorithm": "fedrep",
    "model": "mlp",
    "rounds": 3,
    "seed": 0,
    "model_args": {"sizes": [2, 8, 1]},
    "hparams": {"features": "onnx:enc", "lr": 0.01, "local_steps": 5, "head_steps": 5},
}


class Watcher:
    """Every device's latest retained status, and every uplink's tensor names."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.status: dict[str, dict] = {}
        self.uplinks: list[set[str]] = []
        self._lock = threading.Lock()
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311
        )
        self.client.on_connect = lambda c, *a: c.subscribe(
            [(topics.topic_status_all(FLEET), 1), (topics.topic_up_all(FLEET), 1)]
        )
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        parsed = topics.parse_topic(msg.topic)
        with self._lock:
            if parsed.kind == "status" and msg.payload:
                self.status[parsed.device] = json.loads(msg.payload)
            elif parsed.kind == "up":
                self.uplinks.append(set(round_messages.UpdateMessage.decode(msg.payload).params))

    def model(self, device: str, name: str = "enc") -> dict:
        with self._lock:
            return dict((self.status.get(device, {}).get("models") or {}).get(name) or {})

    def wait(self, cond, timeout: float, what: str, procs=None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        logs = "" if procs is None else "\n".join(procs.log(d)[-1500:] for d in procs.devices)
        raise AssertionError(f"timed out waiting for {what}; statuses {self.status}\n{logs}")

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def operator(url: str) -> MqttSession:
    session = MqttSession(SessionOptions(BrokerAddress.parse(url), client_id=f"test-op-{os.getpid()}"))
    session.start()
    return session


@pytest.fixture
def keys(tmp_path):
    priv, pub = generate_keypair(tmp_path / "keys" / "fleet.key")
    other, _ = generate_keypair(tmp_path / "keys" / "other.key")
    return load_private_key(priv), pub, load_private_key(other), priv


def start_devices(fleet_procs, pub, names) -> None:
    for d in names:
        fleet_procs.start_device(d, "--simulate", "printer-raw", "--model-key", str(pub))


@pytest.mark.broker
@pytest.mark.any_broker
def test_push_heads_on_embeddings_refusals_and_rollback(fleet_procs, broker, keys, tmp_path):
    key, pub, other, _ = keys
    watcher = Watcher(fleet_procs.broker_url)
    session = operator(fleet_procs.broker_url)
    try:
        start_devices(fleet_procs, pub, DEVICES)
        v1 = signed(window_encoder(tmp_path / "v1.onnx", pad_bytes=150_000), tmp_path / "pkg", key, version=1)
        watcher.wait(
            lambda: all(watcher.status.get(d, {}).get("state") == "online" for d in DEVICES), 30, "online"
        )
        out = subprocess.run(
            [sys.executable, "-m", "cloud_aggregator.cli", "push", str(v1.manifest_path), "--fleet", FLEET,
             "--broker", fleet_procs.broker_url, "--allow-plaintext", "--chunk-size", str(CHUNK),
             "--public-key", str(pub)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "pushed enc v1" in out.stdout and "5 chunks" in out.stdout
        watcher.wait(
            lambda: all(watcher.model(d).get("active") == 1 for d in DEVICES), 30, "v1 active", fleet_procs
        )
        assert all(watcher.model(d)["metric_name"] == "probe_r2" for d in DEVICES)

        # Heads stay federated: a FedRep task on the encoder's embeddings; only the body travels.
        fleet_procs.start_aggregator(
            aggregator_toml(
                fleet_procs.broker_url, fleet_procs.work / "aggregator", [HEAD_TASK], expected=DEVICES
            )
        )
        assert fleet_procs.wait_aggregator(60) == 0, fleet_procs.log("aggregator")[-3000:]
        records = fleet_procs.rounds("speed-raw")
        assert [r.status for r in records] == ["completed"] * 3
        assert all(sorted(r.participants) == DEVICES for r in records)
        assert all(m["encoder_version"] == 1.0 for m in records[-1].metrics.values())
        assert watcher.uplinks and all(names == {"fc0.weight", "fc0.bias"} for names in watcher.uplinks)

        # Refusals: wrong key, another feature schema, a chunk altered in transit, a worse model.
        push_model(session, FLEET, signed(window_encoder(tmp_path / "f.onnx"), tmp_path / "f", other, version=2),
                   chunk_size=CHUNK)  # fmt: skip
        watcher.wait(lambda: all("signature" in _last(watcher, d) for d in DEVICES), 20, "wrong key refused")
        dwt = window_encoder(tmp_path / "s.onnx", schema_hash=schema_hash())
        push_model(session, FLEET, signed(dwt, tmp_path / "s", key, version=3), chunk_size=CHUNK)
        watcher.wait(
            lambda: all("feature schema" in _last(watcher, d) for d in DEVICES), 20, "schema refused"
        )
        msgs = push_messages(
            FLEET,
            signed(window_encoder(tmp_path / "t.onnx", pad_bytes=70_000), tmp_path / "t", key, version=4),
            chunk_size=CHUNK,
        )
        chunk = model_push.ModelChunk.decode(msgs[1][1], max_bytes=CHUNK)
        msgs[1] = (msgs[1][0], replace(chunk, data=chunk.data[:-1] + b"\x00").encode())
        for topic, payload in msgs:
            session.publish(topic, payload, retain=True)
        watcher.wait(
            lambda: all("altered in transit" in _last(watcher, d) for d in DEVICES), 20, "tamper refused"
        )
        worse = signed(window_encoder(tmp_path / "w.onnx", kind="mean"), tmp_path / "w", key, version=5)
        push_model(session, FLEET, worse, chunk_size=CHUNK)
        watcher.wait(lambda: all("rolled back to v1" in _last(watcher, d) for d in DEVICES), 20, "rollback")
        assert all(watcher.model(d)["active"] == 1 for d in DEVICES)

        out = subprocess.run(
            [sys.executable, "-m", "cloud_aggregator.cli", "fleet", "status", "--fleet", FLEET,
             "--broker", fleet_procs.broker_url, "--allow-plaintext"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        table = out.stdout.split("\n\n", 1)[0]  # the device rows; the fleet's alerts follow a blank line
        lines = {line.split()[0]: line for line in table.splitlines()[1:]}
        assert sorted(lines) == DEVICES
        assert all(
            "online" in lines[d] and "enc v1" in lines[d] and "speed-raw: round 3" in lines[d]
            for d in DEVICES
        )
        assert all("refused v5" in lines[d] for d in DEVICES)
        if isinstance(broker, RabbitNode):
            return  # a stopped device shows only in its retained status: RabbitMQ 3.10 sends none to status/+
        fleet_procs.devices["printer3"].send_signal(signal.SIGTERM)
        fleet_procs.devices["printer3"].wait(10)
        out = subprocess.run(
            [sys.executable, "-m", "cloud_aggregator.cli", "fleet", "status", "--fleet", FLEET,
             "--broker", fleet_procs.broker_url, "--allow-plaintext", "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert json.loads(out.stdout)["printer3"]["state"] == "offline"
    finally:
        session.stop()
        watcher.stop()


def _last(watcher: Watcher, device: str) -> str:
    rejected = watcher.model(device).get("rejected") or []
    return rejected[-1]["reason"] if rejected else ""


@pytest.mark.broker
def test_a_device_killed_mid_transfer_fetches_only_what_it_lacks(fleet_procs, keys, tmp_path):
    key, pub, _, _ = keys
    watcher = Watcher(fleet_procs.broker_url)
    session = operator(fleet_procs.broker_url)
    try:
        start_devices(fleet_procs, pub, ["printer1"])
        pkg = signed(
            window_encoder(tmp_path / "v1.onnx", pad_bytes=400_000), tmp_path / "pkg", key, version=1
        )
        msgs = push_messages(FLEET, pkg, chunk_size=CHUNK)
        offer, chunks = msgs[0], msgs[1:]
        half = len(chunks) // 2
        for topic, payload in [offer, *chunks[:half]]:  # the pusher got half-way so far
            session.publish(topic, payload, retain=True)
        watcher.wait(lambda: watcher.model("printer1").get("transfer", {}).get("have") == half, 30, "half fetched",
                     fleet_procs)  # fmt: skip
        proc = fleet_procs.devices["printer1"]
        proc.kill()  # no clean shutdown: the part file is whatever reached the disk
        proc.wait(10)
        for topic, payload in chunks[half:]:
            session.publish(topic, payload, retain=True)
        start_devices(fleet_procs, pub, ["printer1"])
        watcher.wait(lambda: watcher.model("printer1").get("active") == 1, 30, "v1 active", fleet_procs)
        last = watcher.model("printer1")["last_transfer"]
        assert last["resumed_chunks"] == half and last["chunks"] == len(chunks)
        assert f"resuming: {half} already on disk" in fleet_procs.log("printer1")
    finally:
        session.stop()
        watcher.stop()

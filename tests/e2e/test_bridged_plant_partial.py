"""A plant with its partial aggregator, the operator's way: ``fleet init`` → ``fleet add-plant
--partial-aggregator`` → the written configs, on loopback.

Two real mosquittos from the generated configs (TLS with client certificates, the written ACLs),
the cloud's from ``fleet init`` and the plant's from ``fleet add-plant``; ``serve`` at the cloud
with ``[collect] workers = 1`` and ``plant_workers = ["plant-a"]`` (it coordinates, reading no
upload itself); ``cloud-aggregator worker --plant`` from the plant's ``worker.toml``; two real
``edge-trainer --simulate printer`` processes from their written device folders (``device.toml``
names the plant broker).  A witness on the cloud broker (a test-only certificate and ACL stanza
that reads the fleet's whole tree) counts what crosses the bridge: no device upload, one batch
from the plant per round, and every round completes with both printers.  The second test runs the
worker as its systemd unit would (``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC``): READY once connected,
watchdog pings from its loop, STOPPING on SIGTERM.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import threading
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from cloud_aggregator.fleet.devices import load_ca
from cloud_aggregator.fleet.layout import open_fleet
from cloud_aggregator.local.broker import free_port, start_mosquitto
from cloud_aggregator.serve import worker_wire as wire
from tests.e2e.notify import NotifyListener
from tests.e2e.test_bridged_plant import DEVICES, ROUNDS, add_plant, device, start_bridged, wait_for
from tests.e2e.test_fleet_init_broker import Broker, init
from tests.e2e.test_operator_path import console_script, served_rounds, spawn, stop, tail
from tests.e2e.test_systemd_notify import stop_service

pytestmark = pytest.mark.broker
P = "ioft/v1/plant"
TASK = "speed"

TASKS = f"""
[collect]
deadline_s = 60
startup_wait_s = 30  # waits for the plant worker's state to cross the bridge (plant_workers)
min_participants = {len(DEVICES)}
plant_workers = ["plant-a"]  # `fleet add-plant --partial-aggregator` says so

[[task]]
name = "{TASK}"
algorithm = "fedavg"
model = "sigmoid_glm"
rounds = {ROUNDS}
hparams = {{ lr = 0.1, local_steps = 10 }}
"""


def witness(fleet: Path, port: int, messages: list[str]) -> paho.Client:
    """A TLS subscriber to the fleet's whole tree on the cloud broker, under a test-only identity:
    its certificate from the fleet CA, its ACL stanza appended to the written ACL before the broker
    starts (the generated ACL grants nobody the uploads of a partial plant's devices)."""
    layout = open_fleet(fleet)
    cert, key = load_ca(layout).issue("witness", days=1)
    (fleet / "witness.crt").write_bytes(cert)
    (fleet / "witness.key").write_bytes(key)
    with layout.acl.open("a") as f:
        f.write(f"\n# test only\nuser witness\ntopic read {P}/#\n")
    c = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311,
                    client_id="witness")  # fmt: skip
    c.tls_set(ca_certs=str(layout.ca_cert), certfile=str(fleet / "witness.crt"),
              keyfile=str(fleet / "witness.key"), cert_reqs=ssl.CERT_REQUIRED)  # fmt: skip
    c.on_message = lambda _c, _u, m: messages.append(m.topic)
    return c


def connect(c: paho.Client, port: int) -> None:
    up, subbed = threading.Event(), threading.Event()
    c.on_connect = lambda *_a: up.set()
    c.on_subscribe = lambda *_a: subbed.set()
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    assert up.wait(10), "the witness did not connect"
    c.subscribe(f"{P}/#", qos=1)
    assert subbed.wait(10), "no SUBACK"


@pytest.fixture
def work(enterable_dir: Path) -> Path:
    return enterable_dir


def test_a_partial_plant_from_the_written_files_sends_one_batch_per_round_and_no_upload(work):
    cloud_port, plant_port = free_port(), free_port()
    fleet = init(work, cloud_port)  # fleet init --devices printer1,printer2 (TLS certificates)
    out = add_plant(fleet, plant_port, "--partial-aggregator")
    plant = fleet / "plants" / "plant-a"
    worker_cmd = f"cloud-aggregator worker --plant --id plant-a --config {plant / 'worker.toml'}"
    assert worker_cmd in out.stdout, out.stdout  # what the operator is told to run at the plant
    assert 'plant_workers = ["plant-a"]' in out.stdout
    agg_toml = fleet / "aggregator" / "aggregator.toml"
    with agg_toml.open("a") as f:
        f.write(TASKS)

    crossed: list[str] = []
    w = witness(fleet, cloud_port, crossed)
    cloud = Broker(fleet / "broker" / "mosquitto.conf", cloud_port, work / "cloud.log")
    plant_broker = Broker(plant / "mosquitto.conf", plant_port, work / "plant.log")
    procs: list[subprocess.Popen] = []
    try:
        start_bridged(cloud, plant_broker, work)
        connect(w, cloud_port)
        cloud_aggregator = console_script("cloud-aggregator", "cloud_aggregator.cli")
        aggregator = spawn([*cloud_aggregator, "serve", "--config", str(agg_toml), "--state-dir", str(work / "aggregator")],
                           work / "aggregator.log", cwd=work)  # fmt: skip
        procs.append(aggregator)
        procs.append(spawn([*cloud_aggregator, "worker", "--plant", "--id", "plant-a", "--config", str(plant / "worker.toml")],
                           work / "worker.log", cwd=work))  # fmt: skip
        procs += [device(work, fleet, d) for d in DEVICES]
        refusals = served_rounds(
            aggregator, work, TASK, ROUNDS, DEVICES, work / "worker.log", work / "plant.log"
        )
        assert set().union(*(set(r) for r in refusals.values())) <= {"replay", "stale_round", "resent"}, (
            refusals
        )
        wait_for(
            "the witness missed the last batch", lambda: len(batches(crossed)) >= ROUNDS, work / "cloud.log"
        )
    finally:
        for p in procs:
            stop(p)
        w.disconnect()
        w.loop_stop()
        cloud.stop()
        plant_broker.stop()

    uploads = [t for t in crossed if t.startswith(f"{P}/task/") and "/up/" in t]
    assert uploads == []  # no device upload reached the cloud broker
    assert len(batches(crossed)) == ROUNDS, crossed  # one message per plant per round
    assert f"{P}/status/printer1" in crossed  # statuses still cross: the coordinator sees who is online
    assert "as worker.plant-a " in plant_broker.log()  # the worker logged in with its own certificate
    for log in (cloud.log(), plant_broker.log()):
        assert "denied" not in log.lower(), log
    worker_log = tail(work / "worker.log")
    assert "Traceback" not in worker_log, worker_log


def batches(crossed: list[str]) -> list[str]:
    return [t for t in crossed if t == wire.topic_batch("plant", TASK, "plant-a")]


def test_the_plant_worker_is_ready_once_connected_pings_from_its_loop_and_says_stopping(tmp_path):
    # Prepare: what ioft-plant-worker.service (Type=notify, WatchdogSec=) gives it, no broker yet
    listener = NotifyListener()
    port = free_port()
    config = tmp_path / "worker.toml"
    config.write_text(f'fleet = "plant"\nbroker = "mqtt://127.0.0.1:{port}"\nallow_plaintext = true\n')
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloud_aggregator.cli", "worker", "--plant", "--id", "plant-a", "--config", str(config)],
        stdout=log, stderr=subprocess.STDOUT, env=listener.env(0.6),
    )  # fmt: skip
    broker = None
    try:
        # Execute / Assert: its loop turns before the broker is there (no READY), READY once connected
        listener.wait_for("EXTEND_TIMEOUT_USEC=1200000", 30)
        assert listener.count("READY=1") == 0
        broker = start_mosquitto(port, log_file=tmp_path / "mosquitto.log")
        ready = listener.wait_for("READY=1", 30)
        listener.pings_then_stops(proc, ready)
    finally:
        stop_service(proc, log, listener, broker)
    assert "Traceback" not in (tmp_path / "worker.log").read_text()

"""A plant's mosquitto bridged to the cloud broker (``fleet add-plant``), as written, on loopback.

Two real mosquittos started as root from the generated configs (the cloud's from ``fleet
init``, the plant's from ``fleet add-plant``), each dropping to the ``mosquitto`` user with a
clean log; two real ``edge-trainer --simulate printer`` processes on the plant broker (their
``device.toml`` names it), ``serve`` on the cloud broker.  Topics are unchanged: the devices
run as they would on the cloud.

Then the cloud broker is SIGKILLed after printer1 answered round 1 (its retained announcement,
the devices' statuses and the bridge's session there are gone: nothing was saved), printer2
starts while the cloud is down (it trains on the announcement the plant kept, and its upload
waits in the plant's queue for the bridge), and the cloud comes back on the same port: the
bridge reconnects, the aggregator's on-connect hook republishes the announcement, and every
round completes with both printers.

The aggregator's session is a clean one, so an uplink the bridge delivers before the aggregator
has subscribed again is gone; the republished announcement makes each device re-send its answer
(``edge.daemon``), which covers that.  That the plant really queues uplinks across a cloud
restart is checked apart, with a persistent subscriber (the second test); the third runs the
bridge over MQTT 5 (``--bridge-protocol mqttv50``).
"""

from __future__ import annotations

import re
import ssl
import subprocess
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from cloud_aggregator.fleet.layout import open_fleet
from cloud_aggregator.local.broker import free_port
from tests.e2e.test_access import Client
from tests.e2e.test_fleet_init_broker import Broker, assert_clean_start, cli, init
from tests.e2e.test_operator_path import console_script, served_rounds, spawn, stop, tail

pytestmark = pytest.mark.broker
DEVICES = ("printer1", "printer2")
ROUNDS = 2
#: Only guards against hanging the suite; nothing asserts on how long a step took.
WAIT_S = 90

TASKS = f"""
[collect]
deadline_s = 60
startup_wait_s = 1  # round 1 goes out at once; it waits for both uploads (min_participants)
min_participants = {len(DEVICES)}

[[task]]
name = "speed"
algorithm = "pflda"
model = "sigmoid_glm"
rounds = {ROUNDS}
hparams = {{ lr = 0.1, weight_decay = 0.0003, local_steps = 10, lam = 0.9 }}
server = {{ weighting = "uniform" }}
"""


def wait_for(what: str, ok, *logs: Path, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"{what}:\n" + "\n---\n".join(tail(p) for p in logs)
        time.sleep(0.1)


def add_plant(
    root: Path, port: int, *extra: str, devices: tuple[str, ...] = DEVICES
) -> subprocess.CompletedProcess:
    """``fleet add-plant`` of plant-a on loopback ``port`` (bridge retry 1-2 s), plus ``extra`` options."""
    out = cli("fleet", "add-plant", "--dir", str(root), "--plant", "plant-a", "--devices", ",".join(devices),
              "--host", "127.0.0.1", "--port", str(port), "--bind", "127.0.0.1", "--bridge-retry", "1,2", *extra)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return out


def start_bridged(cloud: Broker, plant: Broker, work: Path) -> None:
    """Both brokers start clean and the plant's bridge connects to the cloud."""
    assert_clean_start(cloud)
    assert_clean_start(plant)
    wait_for("the bridge did not connect", lambda: "as bridge.plant-a " in cloud.log(), work / "cloud.log")


def device(work: Path, fleet: Path, name: str) -> subprocess.Popen:
    return spawn(
        [*console_script("edge-trainer", "edge.cli"), "--device", name, "--config",
         str(fleet / "devices" / name / "device.toml"), "--simulate", "printer",
         "--state-dir", str(work / "state" / name)],
        work / f"{name}.log",
        cwd=work,
    )  # fmt: skip


@pytest.fixture
def work(enterable_dir: Path) -> Path:
    return enterable_dir


def test_devices_on_a_bridged_plant_complete_rounds_across_a_cloud_broker_restart(work):
    cloud_port, plant_port = free_port(), free_port()
    fleet = init(work, cloud_port)  # fleet init --devices printer1,printer2 (cloud on cloud_port)
    add_plant(fleet, plant_port)
    plant = fleet / "plants" / "plant-a"
    layout = open_fleet(fleet)
    for d in DEVICES:  # each device now dials the plant broker; the topics are the cloud's
        assert layout.plant_brokers[d] == f"mqtts://127.0.0.1:{plant_port}"
        assert (
            f'broker = "mqtts://127.0.0.1:{plant_port}"'
            in (fleet / "devices" / d / "device.toml").read_text()
        )
    agg_toml = fleet / "aggregator" / "aggregator.toml"
    with agg_toml.open("a") as f:
        f.write(TASKS)

    cloud = Broker(fleet / "broker" / "mosquitto.conf", cloud_port, work / "cloud.log")
    plant_broker = Broker(plant / "mosquitto.conf", plant_port, work / "plant.log")
    procs: list[subprocess.Popen] = []
    try:
        start_bridged(cloud, plant_broker, work)
        aggregator = spawn(
            [*console_script("cloud-aggregator", "cloud_aggregator.cli"), "serve", "--config", str(agg_toml),
             "--state-dir", str(work / "aggregator")],
            work / "aggregator.log",
            cwd=work,
        )  # fmt: skip
        procs.append(aggregator)
        procs.append(device(work, fleet, "printer1"))
        answered = re.compile(r"task speed round 1 ")
        wait_for("printer1 did not answer round 1", lambda: answered.search(tail(work / "printer1.log")),
                 work / "printer1.log", work / "aggregator.log", work / "plant.log")  # fmt: skip

        cloud.proc.kill()  # SIGKILL: the cloud saves nothing (retained announcement, statuses, sessions)
        cloud.proc.wait(10)
        procs.append(device(work, fleet, "printer2"))  # joins while the cloud is down
        wait_for("printer2 did not answer round 1 from the plant's retained announcement",
                 lambda: answered.search(tail(work / "printer2.log")), work / "printer2.log", work / "plant.log")  # fmt: skip
        assert "as printer2 " in plant_broker.log()

        cloud = Broker(fleet / "broker" / "mosquitto.conf", cloud_port, work / "cloud-restarted.log")
        store_refusals = served_rounds(aggregator, work, "speed", ROUNDS, DEVICES, work / "plant.log")
        # Round 1 waited for printer2: its upload queued at the plant reached the cloud once the bridge
        # was back, and so did the copy it re-sent on the republished announcement (whichever came
        # while the aggregator was subscribed); a second copy is only refused as a repeat.
        for d in DEVICES:
            assert set(store_refusals.get(d, {})) <= {"replay", "stale_round", "resent"}, store_refusals
        restarted = cloud.log()
        assert "as bridge.plant-a " in restarted and "as aggregator " in restarted, restarted
        assert not any(f"as {d} " in cloud.log() for d in DEVICES)  # devices only ever saw the plant broker
        for name in DEVICES:
            log = tail(work / f"{name}.log")
            assert "Traceback" not in log and "refused" not in log, log
        assert "Warning" not in plant_broker.log() and "denied" not in plant_broker.log(), plant_broker.log()
    finally:
        for p in procs:
            stop(p)
        cloud.stop()
        plant_broker.stop()


def persistent_client(
    port: int, ca: Path, cert: Path, key: Path, messages: list, topics: tuple[str, ...] = ()
) -> paho.Client:
    """A subscriber with a persistent session (clean_session False) on the cloud broker, connected
    and (QoS 1) subscribed to ``topics`` when it returns."""
    # The broker makes the username (the certificate CN) the client id anyway.
    c = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311,
                    client_id="witness", clean_session=False)  # fmt: skip
    c.tls_set(ca_certs=str(ca), certfile=str(cert), keyfile=str(key), cert_reqs=ssl.CERT_REQUIRED)
    c.on_message = lambda _c, _u, m: messages.append((m.topic, bytes(m.payload)))
    up, subbed = threading.Event(), threading.Event()
    c.on_connect = lambda *_a: up.set()
    c.on_subscribe = lambda *_a: subbed.set()
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    assert up.wait(10), "the witness did not connect"
    if topics:
        c.subscribe([(t, 1) for t in topics])
        assert subbed.wait(10), "no SUBACK"
    return c


def test_uplinks_published_while_the_cloud_is_down_wait_at_the_plant_and_cross_when_it_is_back(work):
    cloud_port, plant_port = free_port(), free_port()
    fleet = init(work, cloud_port)
    add_plant(fleet, plant_port, devices=("printer1",))
    layout = open_fleet(fleet)
    p = "ioft/v1/plant"
    agg = (layout.ca_cert, layout.cert("aggregator"), layout.key("aggregator"))
    cloud = Broker(fleet / "broker" / "mosquitto.conf", cloud_port, work / "cloud.log")
    plant = Broker(fleet / "plants" / "plant-a" / "mosquitto.conf", plant_port, work / "plant.log")
    got: list[tuple[str, bytes]] = []
    try:
        wait_for(
            "the bridge did not connect", lambda: "as bridge.plant-a " in cloud.log(), work / "cloud.log"
        )
        witness = persistent_client(cloud_port, *agg, got, (f"{p}/task/+/up/+", f"{p}/status/+"))
        witness.disconnect()
        witness.loop_stop()

        cloud.stop()  # SIGTERM: it saves its sessions (the witness's, the bridge's) and retained messages
        printer1 = Client(
            plant_port, ca=layout.ca_cert, cert=(layout.cert("printer1"), layout.key("printer1"))
        )
        outsider = Client(
            plant_port, ca=layout.ca_cert, cert=(layout.cert("printer2"), layout.key("printer2"))
        )
        try:
            assert printer1.connect() and outsider.connect()  # printer2 is enrolled, but not in this plant
            for i in range(3):  # the plant acks each (QoS 1) and queues it for the bridge
                printer1.publish(f"{p}/task/speed/up/printer1", b"upload %d" % i)
            printer1.publish(f"{p}/task/speed/up/printer2", b"impersonation")  # the plant's ACL drops it
            outsider.publish(f"{p}/task/speed/up/printer2", b"not this plant's")  # the cloud ACL drops it
        finally:
            printer1.close()
            outsider.close()

        cloud = Broker(fleet / "broker" / "mosquitto.conf", cloud_port, work / "cloud-restarted.log")
        wait_for("the bridge did not reconnect", lambda: "as bridge.plant-a " in cloud.log(),
                 work / "cloud-restarted.log", work / "plant.log")  # fmt: skip
        witness = persistent_client(cloud_port, *agg, got)  # its session kept what came meanwhile
        try:
            want = [(f"{p}/task/speed/up/printer1", b"upload %d" % i) for i in range(3)]
            wait_for("the queued uplinks did not arrive", lambda: [m for m in got if m in want] == want,
                     work / "plant.log", work / "cloud-restarted.log", timeout=20)  # fmt: skip
            time.sleep(0.5)  # anything else that was going to cross has crossed
        finally:
            witness.disconnect()
            witness.loop_stop()
        uploads = [m for m in got if "/up/" in m[0]]
        # In order, once each; neither the impersonation (plant ACL) nor the outsider (cloud ACL) crossed.
        assert uploads == want, got
    finally:
        cloud.stop()
        plant.stop()


def test_an_mqtt5_bridge_carries_statuses_out_and_announcements_in(work):
    cloud_port, plant_port = free_port(), free_port()
    fleet = init(work, cloud_port)
    add_plant(fleet, plant_port, "--bridge-protocol", "mqttv50", devices=("printer1",))
    layout = open_fleet(fleet)
    p = "ioft/v1/plant"
    cloud = Broker(fleet / "broker" / "mosquitto.conf", cloud_port, work / "cloud.log")
    plant = Broker(fleet / "plants" / "plant-a" / "mosquitto.conf", plant_port, work / "plant.log")
    got: list[tuple[str, bytes]] = []
    try:
        assert_clean_start(plant)
        wait_for("no MQTT 5 bridge", lambda: "as bridge.plant-a (p5," in cloud.log(), work / "cloud.log")
        aggregator = persistent_client(cloud_port, layout.ca_cert, layout.cert("aggregator"),
                                       layout.key("aggregator"), got, (f"{p}/status/+",))  # fmt: skip
        printer1 = Client(
            plant_port, ca=layout.ca_cert, cert=(layout.cert("printer1"), layout.key("printer1"))
        )
        try:
            aggregator.publish(f"{p}/task/speed/down", b"announcement", qos=1, retain=True).wait_for_publish(
                10
            )
            assert printer1.connect()
            assert printer1.subscribe(f"{p}/task/+/down") == [1]
            printer1.publish(f"{p}/status/printer1", b"online")
            wait_for("nothing crossed", lambda: printer1.got(f"{p}/task/speed/down", b"announcement")
                     and (f"{p}/status/printer1", b"online") in got, work / "plant.log", work / "cloud.log")  # fmt: skip
        finally:
            printer1.close()
            aggregator.disconnect()
            aggregator.loop_stop()
    finally:
        cloud.stop()
        plant.stop()

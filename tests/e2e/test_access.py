"""Per-device access on a real mosquitto running the config `cloud-aggregator fleet init` generates.

Raw paho clients (MQTT 3.1.1, like the fleet) play the devices and the aggregator.
Under 3.1.1 mosquitto acknowledges an unauthorised QoS 1 publish (PUBACK) and drops
it, so a refused publish is shown by a subscriber with the right to read it that
never receives it, while the allowed publish sent just after does arrive.
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from cloud_aggregator.fleet.init import AGGREGATOR, OPERATOR, FleetLayout, init_fleet
from cloud_aggregator.local.broker import BrokerProcess
from cloud_aggregator.local.fleet import FLEET, LocalFleet, aggregator_toml, pflda_task
from cloud_aggregator.operator import operator_slot
from edge.config import DeviceConfig
from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import BrokerAddress, MqttError, SessionOptions, TlsConfig
from tests.conftest import tls_fleet_broker

pytestmark = pytest.mark.broker
DEVICES = ("printer1", "printer2")
HOSTS = ("127.0.0.1", "localhost")
#: How long a message the broker would deliver may take on a loaded 2-core box, at most.
SETTLE_S = 1.0


def _fleet_broker(root: Path, auth: str) -> Iterator[tuple[FleetLayout, BrokerProcess]]:
    return tls_fleet_broker(root, DEVICES, auth=auth, hosts=HOSTS, bind="127.0.0.1")


@pytest.fixture(scope="module")
def cert_fleet(tmp_path_factory) -> Iterator[tuple[FleetLayout, BrokerProcess]]:
    yield from _fleet_broker(tmp_path_factory.mktemp("certs"), "certs")


@pytest.fixture(scope="module")
def pw_fleet(tmp_path_factory) -> Iterator[tuple[FleetLayout, BrokerProcess]]:
    yield from _fleet_broker(tmp_path_factory.mktemp("passwords"), "passwords")


class Client:
    """A paho client that records its CONNACK, SUBACK codes, messages and disconnection."""

    def __init__(
        self,
        port: int,
        *,
        ca: Path | None,
        cert: tuple[Path, Path] | None = None,
        username: str | None = None,
        password: str | None = None,
        client_id: str = "",
    ) -> None:
        self.port = port
        self.c = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311
        )
        if ca is not None:
            self.c.tls_set(
                ca_certs=str(ca),
                certfile=str(cert[0]) if cert else None,
                keyfile=str(cert[1]) if cert else None,
                cert_reqs=ssl.CERT_REQUIRED,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
        if username is not None:
            self.c.username_pw_set(username, password)
        self.connack: paho.ReasonCode | None = None
        self.error: Exception | None = None
        self.up, self.gone = threading.Event(), threading.Event()
        self.subacks: dict[int, list[int]] = {}
        self.messages: list[tuple[str, bytes]] = []
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = lambda *a: self.gone.set()
        self.c.on_subscribe = self._on_subscribe
        self.c.on_message = lambda c, u, m: self.messages.append((m.topic, bytes(m.payload)))

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connack = reason_code
        (self.gone if reason_code.is_failure else self.up).set()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.subacks[mid] = [rc.value for rc in reason_codes]

    def connect(self, timeout: float = 10.0) -> bool:
        """True once the broker accepted us; False if TLS, TCP or the CONNACK said no."""
        try:
            self.c.connect("127.0.0.1", self.port, keepalive=30)
        except (OSError, ssl.SSLError) as exc:
            self.error = exc
            return False
        self.c.loop_start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (self.up.is_set() or self.gone.is_set()):
            time.sleep(0.01)
        return self.up.is_set() and not self.gone.is_set()

    def subscribe(self, topic: str) -> list[int]:
        """The SUBACK's return codes for ``topic`` (QoS 1 asked; 0x80 = refused)."""
        _, mid = self.c.subscribe(topic, qos=1)
        deadline = time.monotonic() + 10
        while mid not in self.subacks:
            assert time.monotonic() < deadline, f"no SUBACK for {topic}"
            time.sleep(0.01)
        return self.subacks[mid]

    def publish(self, topic: str, payload: bytes) -> None:
        """QoS 1, waiting for the PUBACK (which 3.1.1 sends for refused publishes too)."""
        self.c.publish(topic, payload, qos=1).wait_for_publish(10)

    def got(self, topic: str, payload: bytes) -> bool:
        return (topic, payload) in self.messages

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def _identity(layout: FleetLayout, name: str, **kw) -> Client:
    if name == OPERATOR:  # its own listener: its certificate and password, one of its logins
        cert = (layout.cert(OPERATOR), layout.key(OPERATOR))
        return Client(layout.operator_port, ca=layout.ca_cert, cert=cert, username=operator_slot(1),
                      password=layout.passwords[OPERATOR], **kw)  # fmt: skip
    if layout.auth == "certs":
        return Client(layout.port, ca=layout.ca_cert, cert=(layout.cert(name), layout.key(name)), **kw)
    return Client(layout.port, ca=layout.ca_cert, username=name, password=layout.passwords[name], **kw)


def _connected(layout: FleetLayout, name: str, **kw) -> Client:
    client = _identity(layout, name, **kw)
    assert client.connect(), f"{name} could not connect: {client.connack} {client.error}"
    return client


def _wait_for(client: Client, topic: str, payload: bytes) -> None:
    deadline = time.monotonic() + 10
    while not client.got(topic, payload):
        assert time.monotonic() < deadline, f"positive control never arrived on {topic}"
        time.sleep(0.01)


P = f"{topics.PROTOCOL}/{FLEET}"


@pytest.mark.parametrize("fleet", ["cert_fleet", "pw_fleet"])
def test_a_device_cannot_speak_for_another_device_or_the_cloud(fleet, request):
    layout, _ = request.getfixturevalue(fleet)
    agg = _connected(layout, AGGREGATOR)
    watcher_dev = _connected(layout, "printer2")  # reads what devices may read: broadcasts, own downlink
    p1 = _connected(layout, "printer1")
    try:
        assert agg.subscribe(topics.topic_up_all(FLEET)) == [1]
        assert agg.subscribe(topics.topic_status_all(FLEET)) == [1]
        assert watcher_dev.subscribe(f"{P}/task/+/down") == [1]
        assert watcher_dev.subscribe(f"{P}/task/+/down/printer2") == [1]
        assert watcher_dev.subscribe(topics.topic_model_offer_all(FLEET)) == [1]
        forged = [
            (topics.topic_up(FLEET, "speed", "printer2"), b"forged update"),
            (topics.topic_status(FLEET, "printer2"), b"forged status"),
            (topics.topic_down(FLEET, "speed"), b"forged broadcast"),
            (topics.topic_down_device(FLEET, "speed", "printer2"), b"forged downlink"),
            (topics.topic_model_offer(FLEET, "enc"), b"forged model offer"),
        ]
        for topic, payload in forged:
            p1.publish(topic, payload)
        # Positive controls, sent after the forgeries on the same connection: the broker handles
        # one client's packets in order, so by the time these arrive the forgeries would have too.
        own = [
            (topics.topic_up(FLEET, "speed", "printer1"), b"own update"),
            (topics.topic_status(FLEET, "printer1"), b"own status"),
        ]
        for topic, payload in own:
            p1.publish(topic, payload)
        for topic, payload in own:
            _wait_for(agg, topic, payload)
        # The cloud's own downlink does reach the device, through the same subscriptions.
        agg.publish(topics.topic_down_device(FLEET, "speed", "printer2"), b"real downlink")
        _wait_for(watcher_dev, topics.topic_down_device(FLEET, "speed", "printer2"), b"real downlink")
        time.sleep(SETTLE_S)
        seen = agg.messages + watcher_dev.messages
        assert not [m for m in seen if m in forged], seen
    finally:
        for c in (agg, watcher_dev, p1):
            c.close()


@pytest.mark.parametrize("fleet", ["cert_fleet", "pw_fleet"])
def test_a_device_cannot_read_other_devices_uplinks_or_downlinks(fleet, request):
    layout, _ = request.getfixturevalue(fleet)
    agg = _connected(layout, AGGREGATOR)
    p1 = _connected(layout, "printer1")
    spy = _connected(layout, "printer2")
    try:
        # mosquitto (since 1.3.5, still 2.0.11) does not check a 3.1.1 SUBSCRIBE against the ACL
        # file: every filter is granted at the QoS asked, and the read ACL is applied to each
        # message at delivery instead.  So the SUBACK proves nothing; non-delivery does.
        filters = [
            topics.topic_up(FLEET, "speed", "printer1"),
            topics.topic_down_device(FLEET, "speed", "printer1"),
            topics.topic_status(FLEET, "printer1"),
            topics.topic_up_all(FLEET),
            f"{P}/task/+/down/+",
            f"{P}/#",
            "#",
        ]
        assert {f: spy.subscribe(f) for f in filters} == {f: [1] for f in filters}
        assert agg.subscribe(topics.topic_up_all(FLEET)) == [1]
        private = [
            (p1, topics.topic_up(FLEET, "speed", "printer1"), b"printer1's update"),
            (p1, topics.topic_status(FLEET, "printer1"), b"printer1's status"),
            (agg, topics.topic_down_device(FLEET, "speed", "printer1"), b"printer1's downlink"),
        ]
        for client, topic, payload in private:
            client.publish(topic, payload)
        # Positive controls: the aggregator does get printer1's uplink, and the broadcast published
        # after everything else reaches the spy through the very same wildcard subscriptions.
        _wait_for(agg, topics.topic_up(FLEET, "speed", "printer1"), b"printer1's update")
        agg.publish(topics.topic_down(FLEET, "speed"), b"broadcast")
        _wait_for(spy, topics.topic_down(FLEET, "speed"), b"broadcast")
        time.sleep(SETTLE_S)
        assert {t for t, _ in spy.messages} == {topics.topic_down(FLEET, "speed")}, spy.messages
    finally:
        for c in (agg, p1, spy):
            c.close()


@pytest.mark.parametrize("fleet", ["cert_fleet", "pw_fleet"])
def test_only_a_device_writes_its_answers_and_only_the_cloud_reads_them(fleet, request):
    """``answer/<device>/<task>`` (edge.serving): printer1 cannot answer for printer2, printer2 cannot
    read printer1's answers; the aggregator (and its console) and the operator read every device's."""
    layout, _ = request.getfixturevalue(fleet)
    agg, op = _connected(layout, AGGREGATOR), _connected(layout, OPERATOR)
    p1, spy = _connected(layout, "printer1"), _connected(layout, "printer2")
    try:
        for client in (agg, op, spy):
            assert client.subscribe(topics.topic_answer_all(FLEET)) == [1]
        forged = (topics.topic_answer(FLEET, "printer2", "speed"), b"forged answer")
        own = (topics.topic_answer(FLEET, "printer1", "speed"), b"printer1's answer")
        p1.publish(*forged)
        p1.publish(*own)  # after the forgery, on the same connection: it arrives after it would have
        _wait_for(agg, *own)
        _wait_for(op, *own)
        spy.publish(topics.topic_answer(FLEET, "printer2", "speed"), b"printer2's answer")
        _wait_for(agg, topics.topic_answer(FLEET, "printer2", "speed"), b"printer2's answer")
        time.sleep(SETTLE_S)
        assert forged not in agg.messages + op.messages
        assert own not in spy.messages, spy.messages
    finally:
        for c in (agg, op, p1, spy):
            c.close()


def test_the_cloud_reads_every_devices_alerts(cert_fleet):
    """``alert/<device>/<rule>`` (edge.serving.alerts): the aggregator and the operator (whose
    login the console uses) receive printer1's raise; printer2 neither reads it nor forges one."""
    layout, _ = cert_fleet
    agg, op = _connected(layout, AGGREGATOR), _connected(layout, OPERATOR)
    p1, spy = _connected(layout, "printer1"), _connected(layout, "printer2")
    try:
        for client in (agg, op, spy):
            client.subscribe(topics.topic_alert_all(FLEET))
        forged = (topics.topic_alert(FLEET, "printer1", "worn_tool"), b"forged raise")
        own = (topics.topic_alert(FLEET, "printer1", "worn_tool"), b"printer1's raise")
        spy.publish(*forged)
        p1.publish(*own)
        _wait_for(agg, *own)
        _wait_for(op, *own)
        time.sleep(SETTLE_S)
        assert forged not in agg.messages + op.messages
        assert own not in spy.messages, spy.messages
    finally:
        for c in (agg, op, p1, spy):
            c.close()


def test_a_device_cannot_take_over_the_aggregators_client_id(cert_fleet):
    """With ``use_username_as_clientid`` the broker replaces the client id with the certificate's
    CN, so a device claiming the aggregator's id neither disconnects it nor inherits its session."""
    layout, _ = cert_fleet
    agg = _connected(layout, AGGREGATOR, client_id=AGGREGATOR)
    p1 = _connected(layout, "printer1")
    try:
        assert agg.subscribe(topics.topic_up_all(FLEET)) == [1]
        thief = _connected(layout, "printer2", client_id=AGGREGATOR)
        try:
            time.sleep(SETTLE_S)
            assert not agg.gone.is_set(), "the aggregator was disconnected by a device reusing its id"
            p1.publish(topics.topic_up(FLEET, "speed", "printer1"), b"after the takeover attempt")
            _wait_for(agg, topics.topic_up(FLEET, "speed", "printer1"), b"after the takeover attempt")
            assert thief.messages == []
        finally:
            thief.close()
    finally:
        agg.close()
        p1.close()


def test_the_operator_identity_reads_the_fleet_status(cert_fleet):
    """``fleet status --config operator/operator.toml``: its own certificate, read-only on statuses."""
    layout, _ = cert_fleet
    p1 = _connected(layout, "printer1")
    try:
        status = {"device": "printer1", "state": "online", "tasks": {}}
        p1.c.publish(
            topics.topic_status(FLEET, "printer1"), json.dumps(status).encode(), qos=1, retain=True
        ).wait_for_publish(10)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "cloud_aggregator.cli",
                "fleet",
                "status",
                "--config",
                str(layout.toml(OPERATOR)),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout)["printer1"]["state"] == "online"
    finally:
        p1.c.publish(topics.topic_status(FLEET, "printer1"), b"", qos=1, retain=True).wait_for_publish(10)
        p1.close()


def _other_ca(tmp_path: Path) -> FleetLayout:
    return init_fleet(tmp_path / "other", FLEET, DEVICES, hosts=HOSTS, port=1)


def test_clients_without_a_fleet_certificate_cannot_connect(cert_fleet, tmp_path):
    layout, _ = cert_fleet
    other = _other_ca(tmp_path)
    # Positive control: the real printer1 gets in.
    ok = _identity(layout, "printer1")
    assert ok.connect()
    ok.close()
    attempts = {
        "no certificate": Client(layout.port, ca=layout.ca_cert),
        # Same CN, same fleet name, but signed by another CA.
        "certificate from another CA": Client(
            layout.port, ca=layout.ca_cert, cert=(other.cert("printer1"), other.key("printer1"))
        ),
        # The broker's own key pair offered as a client certificate (its EKU says server only).
        "server certificate as client": Client(
            layout.port,
            ca=layout.ca_cert,
            cert=(layout.root / "broker/server.crt", layout.root / "broker/server.key"),
        ),
        "plain MQTT to the TLS port": Client(layout.port, ca=None),
        "plain MQTT with a device's name": Client(layout.port, ca=None, username="printer1"),
    }
    outcomes = {}
    for what, client in attempts.items():
        outcomes[what] = client.connect(timeout=5)
        client.close()
    assert not any(outcomes.values()), outcomes


def test_a_device_does_not_trust_a_broker_outside_its_fleet(cert_fleet, tmp_path):
    """Mutual: a device holding another fleet's CA refuses this broker's certificate."""
    layout, _ = cert_fleet
    other = _other_ca(tmp_path)
    client = Client(layout.port, ca=other.ca_cert, cert=(layout.cert("printer1"), layout.key("printer1")))
    assert not client.connect(timeout=5)
    assert isinstance(client.error, ssl.SSLCertVerificationError), client.error
    client.close()


def test_wrong_or_missing_passwords_are_refused(pw_fleet):
    layout, _ = pw_fleet
    ok = _identity(layout, "printer1")
    assert ok.connect()
    ok.close()
    attempts = {
        "wrong password": Client(layout.port, ca=layout.ca_cert, username="printer1", password="guess"),
        "another device's password": Client(
            layout.port, ca=layout.ca_cert, username="printer1", password=layout.passwords["printer2"]
        ),
        "no password": Client(layout.port, ca=layout.ca_cert, username="printer1"),
        "no username": Client(layout.port, ca=layout.ca_cert),
        "unknown user": Client(layout.port, ca=layout.ca_cert, username="printer9", password="x"),
    }
    for what, client in attempts.items():
        assert not client.connect(timeout=5), what
        # 3.1.1 CONNACK 5: not authorised (or 4: bad user name or password).
        assert client.connack is not None and client.connack.value in (4, 5, 134, 135), (what, client.connack)
        client.close()


def test_our_session_refuses_plaintext_and_reports_bad_credentials(pw_fleet):
    layout, broker = pw_fleet
    tls = TlsConfig(str(layout.ca_cert))
    with pytest.raises(MqttError, match="refusing plaintext"):
        MqttSession(
            SessionOptions(BrokerAddress.parse(f"mqtt://127.0.0.1:{broker.port}"), "x", allow_plaintext=False)
        )
    with pytest.raises(MqttError, match="mqtts://"):
        MqttSession(SessionOptions(BrokerAddress.parse(f"mqtt://127.0.0.1:{broker.port}"), "x", tls=tls))
    bad = MqttSession(
        SessionOptions(BrokerAddress.parse(broker.url), "x", username="printer1", password="guess", tls=tls)
    )
    with pytest.raises(MqttError, match="not retrying"):  # fatal, named: not the timeout's error
        bad.start(timeout=10)
    good = MqttSession(
        SessionOptions(
            BrokerAddress.parse(broker.url),
            "x",
            username="printer1",
            password=layout.passwords["printer1"],
            tls=tls,
        )
    )
    good.start(timeout=10)
    good.stop()


def test_our_session_stops_retrying_on_certificate_failures(cert_fleet, tmp_path):
    """paho retries a failed TLS handshake forever without saying why; our session names the
    reason and gives up at once when the certificates, not the network, are wrong."""
    layout, broker = cert_fleet
    other = _other_ca(tmp_path)
    cases = {
        "refused our client certificate": TlsConfig(
            str(layout.ca_cert), str(other.cert("printer1")), str(other.key("printer1"))
        ),
        "refused our client certificate (TLSV13_ALERT_CERTIFICATE_REQUIRED)": TlsConfig(str(layout.ca_cert)),
        "broker's certificate is not trusted": TlsConfig(
            str(other.ca_cert), str(layout.cert("printer1")), str(layout.key("printer1"))
        ),
    }
    for reason, tls in cases.items():
        session = MqttSession(SessionOptions(BrokerAddress.parse(broker.url), "x", tls=tls))
        with pytest.raises(MqttError, match=re.escape(reason)):  # diagnosed, not the timeout's error
            session.start(timeout=20)
    good = TlsConfig(str(layout.ca_cert), str(layout.cert("printer1")), str(layout.key("printer1")))
    session = MqttSession(SessionOptions(BrokerAddress.parse(broker.url), "x", tls=good))
    session.start(timeout=10)
    session.stop()


def test_a_daemon_with_a_foreign_certificate_exits_naming_the_reason(cert_fleet, tmp_path):
    """``edge-trainer`` with another CA's certificate stops (instead of retrying forever) and says why."""
    layout, broker = cert_fleet
    other = _other_ca(tmp_path)
    folder = tmp_path / "printer1"  # the device folder as copied to the device, with another CA's pair
    shutil.copytree(layout.identity_dir("printer1"), folder)
    shutil.copyfile(other.cert("printer1"), folder / "printer1.crt")
    shutil.copyfile(other.key("printer1"), folder / "printer1.key")
    cfg = folder / "device.toml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge.cli",
            "--device",
            "printer1",
            "--config",
            str(cfg),
            "--broker",
            broker.url,
            "--state-dir",
            str(tmp_path / "p1"),
            "--simulate",
            "printer",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "refused our client certificate" in proc.stderr and "not retrying" in proc.stderr, proc.stderr[
        -3000:
    ]


def test_a_device_refuses_a_plaintext_broker(cert_fleet, tmp_path):
    """The daemon itself: without the explicit opt-in it does not start against ``mqtt://``; and
    its fleet-init (TLS) config pointed at ``mqtt://`` does not start even with it."""
    from edge.cli import config_from_args, parse_args
    from edge.daemon import EdgeTrainer

    layout, _ = cert_fleet
    common = [
        "--state-dir",
        str(tmp_path / "p1"),
        "--simulate",
        "printer",
        "--broker",
        "mqtt://127.0.0.1:1883",
    ]
    bare = config_from_args(parse_args(["--device", "printer1", *common]))
    with pytest.raises(MqttError, match=re.escape("refusing plaintext broker mqtt://127.0.0.1:1883")):
        EdgeTrainer(bare)
    EdgeTrainer(config_from_args(parse_args(["--device", "printer1", *common, "--allow-plaintext"])))

    args = ["--device", "printer1", "--config", str(layout.toml("printer1")), *common, "--allow-plaintext"]
    cfg = config_from_args(parse_args(args))
    assert isinstance(cfg, DeviceConfig) and cfg.tls == TlsConfig(
        str(layout.device_ca("printer1")), str(layout.cert("printer1")), str(layout.key("printer1"))
    )
    with pytest.raises(
        MqttError, match=re.escape("TLS is configured but the broker URL mqtt://127.0.0.1:1883 is plaintext")
    ):
        EdgeTrainer(cfg)


@pytest.mark.slow
def test_a_round_completes_over_tls_with_per_device_certificates(tmp_path):
    for layout, broker in _fleet_broker(tmp_path, "certs"):
        procs = LocalFleet(tmp_path / "run", broker.url, allow_plaintext=False)
        procs.work.mkdir()
        try:
            for d in DEVICES:
                procs.start_device(d, "--config", str(layout.toml(d)))
            tls = (
                f'tls = {{ ca_file = "{layout.ca_cert}", cert_file = "{layout.cert(AGGREGATOR)}", '
                f'key_file = "{layout.key(AGGREGATOR)}" }}'
            )
            task = pflda_task(rounds=2)
            procs.start_aggregator(
                aggregator_toml(
                    broker.url,
                    procs.work / "aggregator",
                    [task],
                    expected=list(DEVICES),
                    min_participants=len(DEVICES),
                    connection=[f'client_id = "{AGGREGATOR}"', tls],
                )
            )
            assert procs.wait_aggregator(120) == 0, procs.log("aggregator")
            records = procs.rounds()
            assert [r.round for r in records] == [1, 2]
            assert all(r.status == "completed" and sorted(r.participants) == list(DEVICES) for r in records)
            for d in DEVICES:
                assert "refused" not in procs.log(d), procs.log(d)
        finally:
            procs.stop_all()

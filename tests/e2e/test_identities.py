"""Each connection's rights follow the identity it proves (issue 32 item 3, issue 33 item 2), on a
real mosquitto running the config and ACL `cloud-aggregator fleet init` writes.

- The operator's certificate alone (no password) gets nothing on the devices' listener: its rights
  are its listener's logins' (certificate AND password).
- The operator's listener makes each login its client id, so the operator cannot connect as
  ``printer1`` and knock the device off (client ids are one namespace across listeners).
- Home Assistant's ``ha`` login reads the discovery configs and the state topics, nothing else,
  and writes nothing.

Raw paho clients, as in ``test_access`` (refused 3.1.1 publishes are acknowledged and dropped, so
a refusal shows as a message a reader with the right never gets, beside a positive control).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from cloud_aggregator.fleet.init import AGGREGATOR, OPERATOR, FleetLayout
from cloud_aggregator.fleet.layout import HOME_ASSISTANT
from cloud_aggregator.local.broker import BrokerProcess
from cloud_aggregator.local.fleet import FLEET
from cloud_aggregator.operator import operator_slot
from cloud_aggregator.serve.home_assistant import DiscoveryRelay
from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions, TlsConfig
from tests.e2e.test_access import SETTLE_S, Client, _connected, _fleet_broker, _wait_for

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def cert_fleet(tmp_path_factory) -> Iterator[tuple[FleetLayout, BrokerProcess]]:
    yield from _fleet_broker(tmp_path_factory.mktemp("certs"), "certs")


@pytest.fixture(scope="module")
def pw_fleet(tmp_path_factory) -> Iterator[tuple[FleetLayout, BrokerProcess]]:
    yield from _fleet_broker(tmp_path_factory.mktemp("passwords"), "passwords")


def _operator(layout: FleetLayout, username: str | None, client_id: str = "") -> Client:
    """A client on the operator's listener with the operator's certificate (and ``username``'s password)."""
    password = layout.passwords[OPERATOR] if username else None
    return Client(layout.operator_port, ca=layout.ca_cert, cert=(layout.cert(OPERATOR), layout.key(OPERATOR)),
                  username=username, password=password, client_id=client_id)  # fmt: skip


def _operator_cert_on_devices_listener(layout: FleetLayout) -> Client:
    return Client(layout.port, ca=layout.ca_cert, cert=(layout.cert(OPERATOR), layout.key(OPERATOR)))


def test_the_operators_certificate_alone_opens_nothing_on_the_devices_listener(cert_fleet):
    """Before: ``operator.crt`` without the password was user ``operator`` there, with every
    operator right (read every status, push models).  (mosquitto grants every 3.1.1 SUBSCRIBE
    and applies the read ACL at delivery, so non-delivery beside a positive control is the proof.)"""
    layout, _ = cert_fleet
    agg = _connected(layout, AGGREGATOR)
    p1 = _connected(layout, "printer1")
    bare = _operator_cert_on_devices_listener(layout)
    op = _operator(layout, operator_slot(1))
    forged = (topics.topic_model_offer(FLEET, "forged"), b"a model the operator never pushed")
    try:
        if not bare.connect():
            return  # refused outright: as good
        assert op.connect(), f"the operator's real login: {op.connack} {op.error}"
        for client in (bare, op):
            client.subscribe(topics.topic_status_all(FLEET))
        assert p1.subscribe(topics.topic_model_offer_all(FLEET)) == [1]
        assert agg.subscribe(topics.topic_status_all(FLEET)) == [1]
        bare.publish(*forged)
        bare.publish(topics.topic_status(FLEET, OPERATOR), b'{"state": "online"}')  # as a device
        op.publish(topics.topic_model_offer(FLEET, "control"), b"control")
        _wait_for(p1, topics.topic_model_offer(FLEET, "control"), b"control")
        p1.publish(topics.topic_status(FLEET, "printer1"), b'{"state": "online"}')
        _wait_for(op, topics.topic_status(FLEET, "printer1"), b'{"state": "online"}')
        _wait_for(agg, topics.topic_status(FLEET, "printer1"), b'{"state": "online"}')
        time.sleep(SETTLE_S)
        assert bare.messages == []
        assert not p1.got(*forged)
        assert [t for t, _ in agg.messages] == [topics.topic_status(FLEET, "printer1")]
    finally:
        for c in (bare, op, agg, p1):
            c.close()


@pytest.mark.parametrize("fleet", ["cert_fleet", "pw_fleet"])
def test_the_operator_cannot_knock_a_device_off_by_taking_its_client_id(fleet, request):
    """Before: the operator's listener kept the client's id, so ``operator`` connecting as
    ``printer1`` disconnected the live printer1 (and the two flapped)."""
    layout, _ = request.getfixturevalue(fleet)
    agg = _connected(layout, AGGREGATOR)
    p1 = _connected(layout, "printer1")
    try:
        assert agg.subscribe(topics.topic_status(FLEET, "printer1")) == [1]
        for username in (OPERATOR, operator_slot(1)):
            thief = _operator(layout, username, client_id="printer1")
            try:
                thief.connect()
                time.sleep(SETTLE_S)
                assert not p1.gone.is_set(), f"printer1 was knocked off by the operator's {username}"
            finally:
                thief.close()
        p1.publish(topics.topic_status(FLEET, "printer1"), b'{"state": "online"}')
        _wait_for(agg, topics.topic_status(FLEET, "printer1"), b'{"state": "online"}')
    finally:
        agg.close()
        p1.close()


def test_on_the_devices_listener_the_certificates_name_is_the_client_id(cert_fleet):
    """printer1's certificate asking for client id ``printer2``: mosquitto 2.0.11 cannot refuse the
    id, it replaces it with the certificate's name, so printer2 stays connected and what the
    connection writes is judged as printer1's.  (Held before this change too: a guard.)"""
    layout, _ = cert_fleet
    agg = _connected(layout, AGGREGATOR)
    p2 = _connected(layout, "printer2")
    thief = _connected(layout, "printer1", client_id="printer2")
    try:
        assert agg.subscribe(topics.topic_status_all(FLEET)) == [1]
        thief.publish(topics.topic_status(FLEET, "printer2"), b'{"state": "forged"}')
        thief.publish(topics.topic_status(FLEET, "printer1"), b'{"state": "online"}')
        _wait_for(agg, topics.topic_status(FLEET, "printer1"), b'{"state": "online"}')
        time.sleep(SETTLE_S)
        assert not p2.gone.is_set(), "printer2 was knocked off by a connection asking for its client id"
        assert not agg.got(topics.topic_status(FLEET, "printer2"), b'{"state": "forged"}')
    finally:
        for c in (agg, p2, thief):
            c.close()


@pytest.mark.parametrize("fleet", ["cert_fleet", "pw_fleet"])
def test_home_assistant_reads_discovery_and_state_and_nothing_else(fleet, request):
    """Issue 33 item 2: ``fleet init`` gives Home Assistant a login of its own (``ha/``)."""
    layout, _ = request.getfixturevalue(fleet)
    settings = (layout.identity_dir(HOME_ASSISTANT) / "home-assistant.txt").read_text()
    assert str(layout.identity_dir(HOME_ASSISTANT) / "ca.crt") in settings
    ha = _connected(layout, HOME_ASSISTANT)
    agg = _connected(layout, AGGREGATOR)
    p1 = _connected(layout, "printer1")
    status = topics.topic_status(FLEET, "printer1")
    try:
        for topic in ("#", "homeassistant/#"):
            assert ha.subscribe(topic) == [1]
        assert agg.subscribe(topics.topic_status_all(FLEET)) == [1]
        # It writes nothing: not a status in a device's name, nor one in its own, nor a discovery config.
        for topic in (status, topics.topic_status(FLEET, HOME_ASSISTANT), "homeassistant/sensor/x/y/config"):
            ha.publish(topic, b'{"state": "forged"}')
        # It reads no uplink, downlink or model push.
        p1.publish(topics.topic_up(FLEET, "speed", "printer1"), b"printer1's update")
        agg.publish(topics.topic_down(FLEET, "speed"), b"broadcast")
        p1.publish(status, json.dumps({"state": "online"}).encode())
        _wait_for(ha, status, b'{"state": "online"}')  # but the state its entities show
        _wait_for(agg, status, b'{"state": "online"}')
        time.sleep(SETTLE_S)
        assert ha.messages == [(status, b'{"state": "online"}')]
        assert not [m for m in agg.messages if m[1] == b'{"state": "forged"}']
    finally:
        for c in (ha, agg, p1):
            c.close()


def _aggregator_session(layout: FleetLayout) -> MqttSession:
    tls = TlsConfig(str(layout.ca_cert), str(layout.cert(AGGREGATOR)), str(layout.key(AGGREGATOR)))
    session = MqttSession(SessionOptions(BrokerAddress.parse(layout.broker_url), AGGREGATOR, tls=tls))
    DiscoveryRelay(session, FLEET).attach()  # as serve does
    session.start(timeout=10)
    return session


def _config(device: str, object_id: str, *, names: str, reads: str) -> bytes:
    """A discovery config from ``device`` that claims to be ``names``'s and shows topic ``reads``."""
    return json.dumps({
        "name": "speed advice", "state_topic": reads, "value_template": "{{ value_json.advice.speed }}",
        "unique_id": f"ioft_{FLEET}_{names}_{object_id}",
        "device": {"identifiers": [f"ioft_{FLEET}_{names}"], "name": names, "manufacturer": "ioft"},
        "availability": [{"topic": topics.topic_status(FLEET, device)}],
    }).encode()  # fmt: skip


def test_a_device_cannot_put_its_entities_on_another_machines_home_assistant_card(cert_fleet):
    """Issue 32 item 4.  Before: printer1 wrote ``homeassistant/sensor/printer1/<x>/config`` itself,
    naming printer2's identifiers, and Home Assistant put the entity on printer2's card.  Now no
    device writes under Home Assistant's prefix; serve republishes each device's own configs rebuilt,
    naming the device that published them, and refuses one that shows another device's topics."""
    layout, _ = cert_fleet
    ha = _connected(layout, HOME_ASSISTANT)
    p1 = _connected(layout, "printer1")
    relay = _aggregator_session(layout)
    forged = _config("printer1", "a", names="printer2", reads=topics.topic_answer(FLEET, "printer1", "speed"))
    spying = _config("printer1", "b", names="printer1", reads=topics.topic_answer(FLEET, "printer2", "speed"))
    try:
        assert ha.subscribe("homeassistant/#") == [1]
        # Straight under the prefix: the broker drops them.
        p1.publish("homeassistant/sensor/printer1/a/config", forged)
        p1.publish(f"homeassistant/sensor/{FLEET}_printer2/a/config", forged)
        # Through serve: rebuilt (the identity is printer1's), or refused (another device's topic).
        p1.publish(topics.topic_discovery(FLEET, "printer1", "sensor", "b"), spying)
        p1.publish(topics.topic_discovery(FLEET, "printer1", "sensor", "a"), forged)
        out = f"homeassistant/sensor/{FLEET}_printer1/a/config"
        deadline = time.monotonic() + 10
        while not [t for t, _ in ha.messages if t == out]:
            assert time.monotonic() < deadline, f"serve never republished printer1's config: {ha.messages}"
            time.sleep(0.01)
        time.sleep(SETTLE_S)
        assert [t for t, _ in ha.messages] == [out]
        config = json.loads(ha.messages[0][1])
        assert config["device"]["identifiers"] == [f"ioft_{FLEET}_printer1"]
        assert config["device"]["name"] == "printer1" and config["unique_id"] == f"ioft_{FLEET}_printer1_a"
        # The device drops the entity: Home Assistant gets an empty retained config, which removes it.
        p1.c.publish(topics.topic_discovery(FLEET, "printer1", "sensor", "a"), b"", qos=1, retain=True)
        _wait_for(ha, out, b"")
    finally:
        relay.stop()
        for c in (ha, p1):
            c.close()

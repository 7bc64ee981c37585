"""MqttSession.wait_connected: one wait for a deadline, a stop event, or neither."""

from __future__ import annotations

import threading

import pytest

from cloud_aggregator.local.broker import free_port
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import BrokerAddress, MqttError, SessionOptions


def _session(url: str) -> MqttSession:
    return MqttSession(SessionOptions(BrokerAddress.parse(url), client_id="wait-test"))


def test_the_wait_ends_connected_at_its_deadline_or_at_a_stop(mosquitto):
    up = _session(mosquitto.url)
    up.start(timeout=None)
    try:
        assert up.wait_connected(stop=threading.Event())  # no deadline: until connected
        assert up.wait_connected(timeout=5.0)
    finally:
        up.stop()
    nowhere = _session(f"mqtt://127.0.0.1:{free_port()}")
    nowhere.start(timeout=None)
    try:
        assert not nowhere.wait_connected(timeout=0.2)
        stop = threading.Event()
        stop.set()
        assert not nowhere.wait_connected(stop=stop)
        assert not nowhere.wait_connected(timeout=60.0, stop=stop)  # whichever comes first
    finally:
        nowhere.stop()


def test_the_wait_raises_once_the_session_gave_up():
    session = _session(f"mqtt://127.0.0.1:{free_port()}")
    session.fatal = "broker refused connection: not authorized (not retrying)"
    with pytest.raises(MqttError, match="not authorized"):
        session.wait_connected(timeout=5.0)
    with pytest.raises(MqttError, match="not authorized"):
        session.wait_connected(stop=threading.Event())


def test_the_old_name_still_waits_and_says_it_goes():
    session = _session(f"mqtt://127.0.0.1:{free_port()}")
    stop = threading.Event()
    stop.set()
    with pytest.warns(DeprecationWarning, match="wait_connected"):
        assert not session.wait_until_connected(stop)

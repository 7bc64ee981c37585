"""A broker started for a test or a demo is the one answering on its port: another process may take
a drawn port before mosquitto binds it (a second test session, an outgoing connection), and a
connection to that port would pass for the broker's."""

from __future__ import annotations

import socket

import pytest

from cloud_aggregator.local import broker

pytestmark = pytest.mark.skipif(broker.find_mosquitto() is None, reason="needs mosquitto")


@pytest.fixture
def squatter():
    """A plain listening socket on a free loopback port: another process's listener."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", broker.free_port()))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_a_broker_on_a_port_another_process_listens_on_says_so(squatter):
    """Before: mosquitto failed to bind and exited, but the wait connected to the squatter first and
    handed back a broker whose URL reached it."""
    with pytest.raises(broker.PortTakenError, match=f"127.0.0.1:{squatter}"):
        broker.start_mosquitto(squatter)


def test_a_drawn_port_taken_before_mosquitto_binds_it_is_drawn_again(squatter, monkeypatch):
    draws = iter([squatter, broker.free_port()])
    monkeypatch.setattr(broker, "free_port", lambda: next(draws))
    started = broker.start_mosquitto()
    try:
        assert started.port != squatter
        assert started.proc.poll() is None and broker.listens(started.proc.pid, started.port)
    finally:
        started.stop()


def test_a_process_listens_on_its_own_port_and_not_on_anothers(squatter):
    started = broker.start_mosquitto()
    try:
        assert broker.listens(started.proc.pid, started.port) is True
        assert broker.listens(started.proc.pid, squatter) is False
    finally:
        started.stop()

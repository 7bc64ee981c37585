"""The one-aggregator check's reading of dropped connections (``cloud_aggregator.serve.singleton``).

A stand-in session scripts the drops exactly; the broker's TCP answer, which the check probes,
comes from a real listening socket on loopback.  The end-to-end cases (two real ``serve``
processes, a real mosquitto with and without the lock topic in its ACL) are in
``tests/e2e/test_twins.py``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from cloud_aggregator.serve.singleton import FleetTakenError, _check_alone
from ioft_protocol.mqtt_inbound import Message


@dataclass
class Broker:
    host: str
    port: int

    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


@dataclass
class Options:
    broker: Broker
    client_id: str = "aggregator"


@dataclass
class ScriptedSession:
    """The counters ``_check_alone`` reads: ``new_drops`` come after the check's first look (it
    counts from there); ``on_wait`` runs each time the check waits for a reconnect."""

    options: Options
    new_drops: int = 0
    failed_attempts: int = 0
    stopped: bool = False
    on_wait: list[Callable[[ScriptedSession], None]] = field(default_factory=list)
    _looked: bool = False

    @property
    def drops(self) -> int:
        seen, self._looked = self._looked, True
        return self.new_drops if seen else 0

    def wait_connected(self, stop: threading.Event | None = None) -> bool:
        if self.on_wait:
            self.on_wait.pop(0)(self)
        return True

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def broker() -> Iterator[Broker]:
    """A loopback socket that takes TCP connections: the broker is up."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield Broker("127.0.0.1", server.getsockname()[1])


def check(session: ScriptedSession, seen: list[Message] | None = None) -> bool:
    return _check_alone(session, "plant", seen or [], threading.Event(), quiet_s=0.3, stale_s=0.6)


def test_two_drops_seen_at_once_with_the_broker_up_are_a_takeover(broker: Broker) -> None:
    """The running aggregator took the session back twice before the check looked again (its drawn
    reconnect delay near 0, this thread slow to run): the second drop must still count.  Before the
    fix both were counted as one handled drop and the check passed: a second ``serve`` ran."""
    session = ScriptedSession(Options(broker), new_drops=2)
    with pytest.raises(FleetTakenError, match="another aggregator is running for fleet plant"):
        check(session)
    assert session.stopped


def test_a_second_drop_during_the_reconnect_wait_is_a_takeover(broker: Broker) -> None:
    def knocked_off_again(s: ScriptedSession) -> None:
        s.new_drops += 1  # reconnected (no failed attempt), and dropped again at once

    session = ScriptedSession(Options(broker), new_drops=1, on_wait=[knocked_off_again])
    with pytest.raises(FleetTakenError):
        check(session)


def test_one_drop_then_quiet_is_not_a_takeover(broker: Broker) -> None:
    """A single drop with the broker up and no lock could be a broker restarted within a second."""
    session = ScriptedSession(Options(broker), new_drops=1)
    assert check(session) is True
    assert not session.stopped


def test_drops_while_the_broker_was_away_start_the_count_over(broker: Broker) -> None:
    """Each drop followed by failed attempts (the broker went away) is a flap, not a takeover."""

    def broker_was_away(s: ScriptedSession) -> None:
        s.failed_attempts += 2

    session = ScriptedSession(Options(broker), new_drops=2, on_wait=[broker_was_away, broker_was_away])
    assert check(session) is True
    assert not session.stopped

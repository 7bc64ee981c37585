"""One aggregator per fleet: a second ``serve`` for a fleet that has one refuses to start.

Why it needs care: the fleet's broker replaces every client id with the certificate's
name (``use_username_as_clientid``), and on a plaintext broker every aggregator uses its
configured ``client_id``; either way two aggregators share one client id, and MQTT
closes the older connection when a newer one with the same id connects.  So the second
aggregator's very first connection knocks the running one off once -- nothing can avoid
that -- and the two would then take turns knocking each other off, every second, forever.

The design, which needs only a publish and a subscribe on one topic of the aggregator's
own (``ioft/<fleet>/aggregator``, readwrite for the ``aggregator`` user in the ACL that
``fleet init`` writes):

* A running aggregator holds a retained **lock** there: its pid, host and start time,
  re-published on every (re)connect.  Its Last Will is an empty retained message on the
  same topic, so a crashed aggregator's lock is cleared by the broker; a clean stop
  clears it too.
* A starting aggregator connects (retrying forever while the broker is away), reads the
  lock and then listens for ``quiet_s`` seconds.  A running aggregator reconnects within
  ``reconnect_min_s`` (0.5 s, a drawn delay) and thereby takes the session back: the newcomer
  sees its connection closed right after it was accepted, stops, and exits naming the running
  one (from the lock).  The running one loses its connection once (twice, rarely: when its
  drawn delay is shorter than the newcomer's wait for the lock, the newcomer checks again).
* A closed connection is not always a takeover: the broker may have gone away (restarted,
  crashed) while the newcomer listened.  A takeover leaves signs on a broker that is still
  there: a live lock, and a broker that takes a TCP connection at once (probed without MQTT,
  so the probe takes no one's session).  Without a lock the newcomer reconnects: if that
  needed failed attempts (refused, unreachable) the broker was away, and the check starts
  again from the reconnect, as the rest of ``serve`` rides out outages.  A second drop in a
  row with the broker up and no lock is a takeover by an aggregator whose ACL lacks the
  lock topic (it lost its connection twice).
* A lock that nothing defends within ``stale_s`` (its holder died while the broker was
  down, so no will fired) is stale: the newcomer says so and takes over.

With an older ACL that lacks the topic, the lock is silently refused by the broker and
the takeover still shows (at the second drop): the refusal then cannot name the other aggregator.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.mqtt_options import MqttError

log = logging.getLogger(__name__)

#: How long a newcomer waits for a running aggregator to take the session back (it reconnects within 0.5 s).
QUIET_S = 3.0
#: How long the check of a dropped connection waits for the broker's TCP answer.
PROBE_S = 2.0


class FleetTakenError(MqttError):
    """Another aggregator is running for this fleet; the message names it where it can."""


def lock_topic(fleet: str) -> str:
    """The retained topic on which the running aggregator of ``fleet`` holds its lock."""
    return topics.topic_aggregator_lock(fleet)


def lock_will(fleet: str) -> tuple[str, bytes]:
    """The aggregator session's Last Will (and its final message on a clean stop): clear the lock."""
    return lock_topic(fleet), b""


@dataclass(frozen=True)
class FleetLock:
    """The lock this process holds: ``payload`` is published retained on ``topic``."""

    topic: str
    payload: bytes


def _describe(payload: bytes) -> str:
    """A lock's holder in words, or the raw payload if it is not ours."""
    try:
        held = json.loads(payload)
        return f"pid {held['pid']} on host {held['host']}, running since {held['since']}"
    except (ValueError, TypeError, KeyError):
        return f"lock {payload[:80]!r}"


def _held(seen: list[Message]) -> bytes | None:
    """The lock another aggregator holds, as last seen on the broker (``None``: none, or cleared)."""
    return seen[-1].payload if seen and seen[-1].payload else None


def _answers(session: MqttSession) -> bool:
    """Whether the broker takes a TCP connection now: no MQTT, so it takes no one's session."""
    b = session.options.broker
    try:
        socket.create_connection((b.host, b.port), timeout=PROBE_S).close()
    except OSError:
        return False
    return True


def _refuse(session: MqttSession, fleet: str, held: bytes | None) -> NoReturn:
    """Stop ``session`` and say which aggregator runs for ``fleet`` (from its lock, where there is one)."""
    session.stop()
    who = f" ({_describe(held)})" if held else ""
    raise FleetTakenError(
        f"another aggregator is running for fleet {fleet}{who}: it took the broker session "
        f"({session.options.client_id!r} at {session.options.broker.url()}) back as soon as this one "
        "connected; stop it first (two aggregators would knock each other off every second)"
    )


def claim_fleet(
    session: MqttSession,
    fleet: str,
    stop: threading.Event | None = None,
    *,
    quiet_s: float = QUIET_S,
    stale_s: float | None = None,
) -> FleetLock:
    """Start ``session`` (retrying forever), and make sure no other aggregator runs for ``fleet``.

    Parameters
    ----------
    session
        The aggregator's session, not started yet; its will should be :func:`lock_will`.
    fleet
        The fleet id.
    stop
        Set to give up waiting for the broker.
    quiet_s
        How long to listen for a running aggregator taking the session back, with no lock seen.
    stale_s
        The same with another's lock seen (default: the session's longest reconnect delay + 5 s).

    Returns
    -------
    FleetLock
        The lock now held (re-published on every reconnect).

    Raises
    ------
    FleetTakenError
        Another aggregator took the session back (the session is stopped).
    MqttError
        The session gave up (bad credentials, refused certificate).
    """
    topic = lock_topic(fleet)
    seen: list[Message] = []
    session.tap(topic, seen.append)
    session.subscribe(topic)
    session.start(timeout=None)
    stop = stop or threading.Event()
    if not session.wait_connected(stop=stop):
        return FleetLock(topic, b"")
    stale_s = session.options.reconnect_max_s + 5.0 if stale_s is None else stale_s
    if not _check_alone(session, fleet, seen, stop, quiet_s, stale_s):
        return FleetLock(topic, b"")
    return _take_lock(session, fleet, topic, seen, stale_s)


def _check_alone(
    session: MqttSession,
    fleet: str,
    seen: list[Message],
    stop: threading.Event,
    quiet_s: float,
    stale_s: float,
) -> bool:
    """Listen ``quiet_s`` (``stale_s`` once another's lock is seen) for another aggregator taking the
    session back (:func:`_refuse`); each drop of the broker starts it over.  ``False``: ``stop`` was set."""
    drops, failed = session.drops, session.failed_attempts
    unexplained = 0  # drops in a row with the broker up and no lock: an aggregator on an older ACL
    deadline = time.monotonic() + quiet_s
    extended = False
    while time.monotonic() < deadline:
        if session.drops > drops:
            now_unexplained = _after_drop(session, fleet, seen, stop, unexplained, failed)
            if now_unexplained is None:
                return False
            unexplained = now_unexplained
            # One drop handled: a second one may already have come (the other aggregator can take
            # the session back within milliseconds of our reconnect, before this thread runs again);
            # counting it handled too would miss the takeover it is.
            drops, failed, extended = drops + 1, session.failed_attempts, False
            deadline = time.monotonic() + quiet_s
            continue
        if seen and seen[-1].payload and not extended:
            extended = True  # another's lock: give its holder time to show up
            deadline = time.monotonic() + stale_s
        time.sleep(0.05)
    return True


def _after_drop(
    session: MqttSession,
    fleet: str,
    seen: list[Message],
    stop: threading.Event,
    unexplained: int,
    failed: int,
) -> int | None:
    """The broker dropped the session while we checked: refuse if another aggregator took it back,
    else wait for the broker.  The drops in a row now unexplained; ``None``: ``stop`` was set."""
    held = _held(seen)
    # A drop with another's lock on a broker that still answers: its holder took the
    # session back.  So is a second drop in a row with the broker up and no lock (an
    # aggregator on an ACL without the lock topic).  Anything else may be the broker
    # going away (restarted, crashed): wait for it and check again.
    if (held is not None or unexplained) and _answers(session):
        _refuse(session, fleet, held)
    seen.clear()  # the reconnect brings the lock as the broker holds it now
    log.warning(
        "fleet %s: the broker closed the connection while this aggregator checked that it is the "
        "only one; waiting for the broker and checking again",
        fleet,
    )
    if not session.wait_connected(stop=stop):
        return None
    if session.failed_attempts == failed:  # back at the first attempt: the broker was up
        return unexplained + 1  # (or restarted within a second): the next such drop decides
    log.info("fleet %s: the broker is back; checking again for another aggregator", fleet)
    return 0


def _take_lock(
    session: MqttSession, fleet: str, topic: str, seen: list[Message], stale_s: float
) -> FleetLock:
    """Stop listening, and publish (retained, and again on every reconnect) this aggregator's lock."""
    session.unsubscribe(topic)
    session.tap(topic, None)
    if seen and seen[-1].payload:
        log.warning(
            "fleet %s: the lock on %s (%s) is stale: no aggregator took the session back within %g s; "
            "taking over",
            fleet,
            topic,
            _describe(seen[-1].payload),
            stale_s,
        )
    since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    lock = FleetLock(
        topic, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode()
    )
    session.on_connect_hooks.append(lambda: session.publish(topic, lock.payload, retain=True, timeout=None))
    session.publish(topic, lock.payload, retain=True)
    log.info("fleet %s: this is its only aggregator (lock on %s)", fleet, topic)
    return lock

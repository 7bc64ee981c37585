"""What a session publishes: bounded, kept across a lost connection, stale copies dropped.

paho alone fails the owner in three ways: a QoS 1 publish made while disconnected
returns a message info whose wait raises ``RuntimeError``; every message handed to it stays in
memory until acked, without bound; and past 65,535 unacknowledged messages its 16-bit ids wrap
and a publish fails with "Message queue full".  So a session hands paho at most ``in_flight``
messages at a time, only while connected, and holds the rest here:

* a message whose ``key`` (its topic, for retained state) is already waiting replaces the
  waiting one, which is stale: the broker would keep only the newer anyway;
* past ``limit`` waiting messages the oldest is dropped;
* on every (re)connect, and whenever the broker acks one, the waiting ones go out in order.

Publishing never raises for a lost connection; a caller that must know waits on the
:class:`Ticket` (``MqttSession.publish(timeout=...)``).  Dropped messages are counted and said
in one log line per episode, when the backlog has gone out.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger(__name__)


#: Guards every ticket's event as it is made or set (held for a few attribute reads).
_TICKETS = threading.Lock()


class Ticket:
    """One publish: ``wait`` for the broker's ack; ``dropped`` once a newer one made it stale.

    Its event is made only when someone looks at it (``done``, ``wait``): a swarm's devices publish
    thousands of messages a second and wait for none, and an ``Event`` (a condition and its lock)
    cost more than the rest of the outbox's bookkeeping.
    """

    __slots__ = ("_acked", "_event", "dropped", "topic")

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.dropped = False
        self._acked = False  # done: acked, or dropped
        self._event: threading.Event | None = None

    @property
    def done(self) -> threading.Event:
        """Set once the broker acked the message or it was dropped."""
        with _TICKETS:
            if self._event is None:
                self._event = threading.Event()
                if self._acked:
                    self._event.set()
            return self._event

    def finish(self) -> None:
        """Mark it done (acked, or dropped), waking whoever waits."""
        with _TICKETS:
            self._acked = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None) -> bool:
        """Whether the broker acked it within ``timeout`` seconds (``False`` if it was dropped)."""
        return self.done.wait(timeout) and not self.dropped


class _Waiting:
    """A message waiting to be handed to paho."""

    __slots__ = ("payload", "qos", "retain", "ticket", "topic")

    def __init__(self, topic: str, payload: bytes, qos: int, retain: bool, ticket: Ticket) -> None:
        self.topic, self.payload, self.qos, self.retain, self.ticket = topic, payload, qos, retain, ticket


#: send(topic, payload, qos, retain) -> (mid, sent): hands one message to the client.
Send = Callable[[str, bytes, int, bool], tuple[int, bool]]


class Outbox:
    """The messages a session has yet to hand to paho, and those paho holds unacked (by mid).

    Parameters
    ----------
    send
        Hands one message to the client; ``(mid, False)`` if it was refused there and then.
    connected
        Whether the session is connected now (messages wait while it is not).
    limit
        Messages held at most (the oldest goes first).
    in_flight
        Messages handed to the client and not yet acked, at most.
    """

    def __init__(self, send: Send, connected: Callable[[], bool], limit: int, in_flight: int) -> None:
        self._send = send
        self._connected = connected
        self.limit = limit
        self.in_flight_limit = in_flight
        self._waiting: OrderedDict[object, _Waiting] = OrderedDict()
        self._unacked: dict[int, Ticket] = {}
        self._early: set[int] = set()  # acks that came before send() returned the mid
        self._state = threading.Lock()  # never held while calling paho (its callbacks take it)
        self._sending = threading.Lock()  # one thread hands messages to paho at a time, in order
        self._again = False
        self._serial = 0
        #: Messages dropped since the last report: superseded by a newer copy, or for room.
        self.superseded = 0
        self.overflowed = 0

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def put(self, topic: str, payload: bytes, qos: int, retain: bool, latest_only: bool) -> Ticket:
        """Queue one message (``latest_only``: it replaces a waiting one on the same topic) and
        send what may go now."""
        ticket = Ticket(topic)
        with self._state:
            self._serial += 1
            key: object = topic if latest_only else self._serial
            old = self._waiting.pop(key, None)
            if old is not None:
                self._drop(old)
                self.superseded += 1
            self._waiting[key] = _Waiting(topic, payload, qos, retain, ticket)
            if len(self._waiting) > self.limit:
                _, oldest = self._waiting.popitem(last=False)
                self._drop(oldest)
                if not self.overflowed:
                    log.warning(
                        "outbound queue full (%d messages waiting for the broker): dropping the oldest",
                        self.limit,
                    )
                self.overflowed += 1
        self.pump()
        return ticket

    @staticmethod
    def _drop(waiting: _Waiting) -> None:
        waiting.ticket.dropped = True
        waiting.ticket.finish()

    def acked(self, mid: int) -> None:
        """The broker acked ``mid`` (paho's on_publish, network thread): room for the next."""
        with self._state:
            ticket = self._unacked.pop(mid, None)
            if ticket is None:
                self._early.add(mid)
        if ticket is not None:
            ticket.finish()
        self.pump()

    def pump(self) -> None:
        """Hand waiting messages to paho while connected and below the in-flight bound.

        Any thread may call it; one hands messages over at a time (in order), and a call that
        finds it busy leaves it to that one (``_again``: it looks once more before leaving).
        Never blocks on the other thread: paho's network thread calls it holding paho's locks.
        With nothing waiting, no early ack to forget and no drop to report it returns at once (each
        ack calls it): a message put meanwhile is handed over by its own ``put``.
        """
        if not (self._waiting or self._early or self.superseded or self.overflowed):
            return
        self._again = True
        while self._again:
            if not self._sending.acquire(blocking=False):
                return
            try:
                self._again = False
                self._hand_over()
            finally:
                self._sending.release()

    def _hand_over(self) -> None:
        state, waiting, unacked = self._state, self._waiting, self._unacked
        while self._connected():
            with state:
                if not waiting or len(unacked) >= self.in_flight_limit:
                    break
                _, msg = waiting.popitem(last=False)
            mid, sent = self._send(msg.topic, msg.payload, msg.qos, msg.retain)
            if not sent:
                self._drop(msg)
                continue
            with state:
                if mid in self._early:
                    self._early.discard(mid)
                    early = True
                else:
                    unacked[mid] = msg.ticket
                    early = False
            if early:
                msg.ticket.finish()
        with state:
            self._early.clear()  # acks of messages sent past the outbox (birth): not ours to match
        self._report()

    def _report(self) -> None:
        """One line per episode of drops, once the backlog has gone out."""
        with self._state:
            if self._waiting or not (self.superseded or self.overflowed):
                return
            superseded, overflowed = self.superseded, self.overflowed
            self.superseded = self.overflowed = 0
        log.info(
            "outbound backlog sent; dropped %d stale messages (%d superseded by a newer one on the same "
            "topic, %d for room)",
            superseded + overflowed,
            superseded,
            overflowed,
        )

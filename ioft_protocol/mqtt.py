"""A thin MQTT session over paho-mqtt 2.x, used by devices and the aggregator alike.

Lifecycle, explicitly (after Home Assistant's MQTT client): the Last Will is set
before connecting; every (re)connect re-publishes the birth messages and
re-subscribes from tracked state; the session reconnects after delays drawn with full jitter
(``ioft_protocol.backoff``: uniform(0, ``reconnect_min_s`` · 2^n), capped at ``reconnect_max_s``,
forever; the first connect is immediate); every failed attempt is logged at INFO
with its reason (refused, unresolvable, TLS handshake and why); bad credentials
and refused certificates stop the retrying; another client that keeps taking our
client id (a copied device folder, a stolen certificate) makes the session back
off, longer each time, and say so (see ``SessionOptions.takeover_limit``); inbound
messages go to a bounded queue that the owner drains on its own thread; outbound ones
go through a bounded outbox (``ioft_protocol.outbox``) that holds them while the broker
is away, so a publish never raises for a lost connection.

Who reads the socket (``ioft_protocol.mqtt_loop``): the thread waiting in :meth:`MqttSession.get`
(the owner: the aggregator's collecting thread, a device's service loop) runs paho's external-loop
steps itself, so a message is read, acked and taken on one thread with no hand-over; a background
thread of the session's own (not paho's ``loop_start``) connects, reconnects with backoff, pings
and reads whenever the owner has been out of ``get`` for ``mqtt_loop.IDLE_S`` or someone else
waits for an ack.  "The network thread" below: whichever of the two reads the socket at the time.

The wire protocol is MQTT 3.1.1 so the session also works against embedded
brokers that speak nothing newer (amqtt).
"""

from __future__ import annotations

import logging
import queue
import random
import socket
import threading
import time
import warnings
from collections.abc import Callable

import paho.mqtt.client as paho

from ioft_protocol.backoff import FullJitter
from ioft_protocol.mqtt_diagnosis import FATAL_CONNACK, AttemptWatch
from ioft_protocol.mqtt_inbound import Inbound, Message
from ioft_protocol.mqtt_loop import BURST, MISC_S, OK, SELECT_S, ReadAheadClient, SocketLoop
from ioft_protocol.mqtt_options import BrokerAddress, BrokerLogin, MqttError, SessionOptions, TlsConfig
from ioft_protocol.mqtt_tls import check_options
from ioft_protocol.outbox import Outbox, Ticket

# The session's words live in the modules beside it; scripts import them from here as well.
__all__ = [
    "TAP_CACHE", "BrokerAddress", "BrokerLogin", "Inbound", "Message", "MqttError", "MqttSession",
    "SessionOptions", "TlsConfig", "check_options", "topic_matches",
]  # fmt: skip

log = logging.getLogger(__name__)

#: Topics whose tap (or its absence) a session remembers at most (a fleet's device topics).
TAP_CACHE = 1 << 16


class MqttSession(AttemptWatch):
    """One connection to the broker, kept alive across broker restarts.

    ``rng`` draws the reconnect delays (:meth:`backoff`); a test passes a seeded one, a swarm its loop's.
    """

    def __init__(self, options: SessionOptions, rng: random.Random | None = None) -> None:
        self.options = options
        self.jitter = FullJitter(rng)
        self.inbound = Inbound(options.inbound_limit)
        self.dropped_inbound = 0
        self.connected = threading.Event()
        self.fatal: str | None = None
        self._subs: dict[str, int] = {}
        self._lock = threading.Lock()
        self._connacked = False  # this connection attempt got a CONNACK (reset before each attempt)
        self._watch_init()
        self.outbox = Outbox(
            self._hand, self.connected.is_set, options.outbound_limit, options.outbound_in_flight
        )
        self._taps: dict[str, Callable[[Message], bool | None]] = {}
        self._filter_taps: dict[str, Callable[[Message], bool | None]] = {}
        #: topic -> its tap (``None``: none), found once per topic: matching a filter builds a
        #: paho matcher (~4 µs), too dear for every upload while a status filter is tapped.
        self._tap_of: dict[str, Callable[[Message], bool | None] | None] = {}
        self.on_connect_hooks: list[Callable[[], None]] = []
        self._ssl = check_options(options)
        self._client = self._make_client()
        #: Who reads the socket (``start`` makes it): the owner in ``get``, else a background thread.
        self._loop: SocketLoop | None = None

    def _make_client(self) -> paho.Client:
        o = self.options
        client = ReadAheadClient(
            callback_api_version=paho.CallbackAPIVersion.VERSION2,
            client_id=o.client_id,
            protocol=paho.MQTTv311,
            clean_session=o.clean_session,
        )
        client.max_queued_messages_set(0)  # unbounded while offline; QoS 1 survives a broker restart
        if o.username is not None:
            client.username_pw_set(o.username, o.password)
        if self._ssl is not None:
            client.tls_set_context(self._ssl)
        if o.will is not None:
            client.will_set(o.will[0], o.will[1], qos=1, retain=True)
        client.on_pre_connect = self._on_pre_connect
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    # -- lifecycle ---------------------------------------------------------
    def start(self, timeout: float | None = 10.0) -> None:
        """Connect in the background; wait up to ``timeout`` s for the first CONNACK.

        Parameters
        ----------
        timeout
            ``None`` (daemons): return at once and keep retrying forever, one INFO line per
            failed attempt.  A number (one-shot commands): raise ``MqttError`` naming the last
            attempt's reason if no connection comes within it; the attempts log at DEBUG only,
            so the caller's one line is all the operator sees.
        """
        b = self.options.broker
        self._quiet_attempts = timeout is not None
        try:
            self._client.connect_async(b.host, b.port, keepalive=self.options.keepalive)
        except (OSError, ValueError) as exc:
            raise MqttError(f"cannot connect to {b.url()}: {exc}") from exc
        self._loop = SocketLoop(
            self._client,
            lambda: self._on_connect_fail(self._client, None),
            lambda: self.fatal is not None,
            self.backoff,
            lambda: self.outbox.unacked > 0,
        )
        self._loop.start(self.options.client_id)
        if timeout is None:
            return
        try:
            up = self.wait_connected(timeout)
        except MqttError:  # gave up: the same stop and one line as a timeout
            up = False
        if not up:
            self.stop()
            why = f": {self.last_error}" if self.last_error else ""
            raise MqttError(self.fatal or f"no connection to {b.url()} within {timeout:g} s{why}")

    def wait_connected(self, timeout: float | None = None, stop: threading.Event | None = None) -> bool:
        """Block until connected (``True``), or until ``timeout`` seconds pass or ``stop`` is set
        (``False``); with neither, however long it takes.

        Raises
        ------
        MqttError
            The session gave up (bad credentials, refused certificate): waiting longer cannot help.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while stop is None or not stop.is_set():
            if self.fatal is not None:
                raise MqttError(self.fatal)
            if self.connected.wait(0.05):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return False

    def wait_until_connected(self, stop: threading.Event) -> bool:
        """Deprecated name of ``wait_connected(stop=stop)``; goes in 0.2.0."""
        warnings.warn(
            "MqttSession.wait_until_connected(stop) is deprecated; use wait_connected(stop=stop)"
            " (removed in 0.2.0)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.wait_connected(stop=stop)

    def tap(self, topic: str, callback: Callable[[Message], bool | None] | None) -> None:
        """Hand messages on ``topic`` to ``callback`` (on the network thread, which may be the owner's
        own in ``get``: no blocking) instead of
        the inbound queue; ``None`` removes the tap.  Subscribe separately.

        ``topic`` may be a filter with ``+`` and ``#`` (a topic's exact tap wins).  A callback that
        returns ``False`` passes the message on to the inbound queue after all.  The network thread
        reads the next message only once the callback returns, so what it holds stays one message.
        """
        with self._lock:
            taps = self._filter_taps if "+" in topic or "#" in topic else self._taps
            self._tap_of = {}
            if callback is None:
                taps.pop(topic, None)
            else:
                taps[topic] = callback

    def stop(self, final: tuple[str, bytes] | None = None) -> None:
        """Publish ``final`` (e.g. a retained offline status), then disconnect cleanly."""
        if final is not None and self.connected.is_set():
            try:
                self.publish(final[0], final[1], retain=True, timeout=2.0)
            except MqttError as exc:
                log.warning("final message not delivered: %s", exc)
        self._client.disconnect()
        if self._loop is not None:
            self._loop.stop()
        self.connected.clear()

    def backoff(self) -> float:
        """Seconds until the next connect attempt: full jitter (``ioft_protocol.backoff``), the
        window doubling from ``reconnect_min_s`` to ``reconnect_max_s`` with each connection ended
        since the last CONNACK; never less than a takeover's wait (``AttemptWatch._back_off``)."""
        o = self.options
        return self.jitter.draw(o.reconnect_min_s, o.reconnect_max_s, self.takeover_wait_s or 0.0)

    # -- subscriptions and publishing ---------------------------------------
    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribe now (if connected) and again after every reconnect."""
        with self._lock:
            self._subs[topic] = qos
        if self.connected.is_set():
            self._client.subscribe(topic, qos)

    def unsubscribe(self, topic: str) -> None:
        """Stop following ``topic`` now and after reconnects (no-op if not subscribed)."""
        with self._lock:
            known = self._subs.pop(topic, None)
        if known is not None and self.connected.is_set():
            self._client.unsubscribe(topic)

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float | None = 10.0,
        latest_only: bool | None = None,
    ) -> Ticket:
        """Publish now, or once the broker is back (never raises for a lost connection).

        Parameters
        ----------
        timeout
            Wait this long for the broker's ack (QoS 1) and raise ``MqttError`` without it; the
            message stays queued and goes out once the connection is back.  ``None``: return at once.
        latest_only
            A newer message on ``topic`` makes this one stale: while it waits for the broker, the
            newer one replaces it.  Default: ``retain`` (the broker keeps only the newest anyway).

        Returns
        -------
        Ticket
            ``wait(timeout)`` for the ack later.
        """
        if not topic or "+" in topic or "#" in topic:
            raise ValueError(f"cannot publish to {topic!r}: a topic is non-empty and has no wildcards")
        latest = retain if latest_only is None else latest_only
        ticket = self.outbox.put(topic, payload, qos, retain, latest)
        if timeout is not None and not ticket.wait(timeout):
            why = "a newer message replaced it" if ticket.dropped else f"no ack within {timeout:g} s"
            if not ticket.dropped and not self.connected.is_set():
                why += " (not connected: it goes out once the broker is back)"
            raise MqttError(f"publish to {topic}: {why}")
        return ticket

    def _hand(self, topic: str, payload: bytes, qos: int, retain: bool) -> tuple[int, bool]:
        """The outbox hands paho one message: ``(mid, kept)``; paho keeps a QoS 1 message that
        found the connection just gone and re-sends it after the reconnect."""
        try:
            info = self._client.publish(topic, payload, qos=qos, retain=retain)
        except ValueError as exc:  # too large for MQTT: nothing to retry
            log.error("dropped a message to %s: %s", topic, exc)
            return 0, False
        if info.rc == paho.MQTT_ERR_SUCCESS or (info.rc == paho.MQTT_ERR_NO_CONN and qos > 0):
            return info.mid, True
        log.warning("dropped a message to %s: %s", topic, paho.error_string(info.rc))
        return info.mid, False

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        self.outbox.acked(mid)

    def get(self, timeout: float | None) -> Message | None:
        """Next inbound message, or ``None`` after ``timeout`` seconds.

        With nothing queued, the calling thread reads the socket itself (``SocketLoop``): the
        message arrives on the thread that takes it.  While the connection is down it waits for
        the background thread (which reconnects) to queue one.
        """
        items = self.inbound.queue
        if items:
            return items.popleft()
        loop = self._loop
        if loop is None or not self.connected.is_set():
            return self._wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        held = loop.take(SELECT_S if timeout is None else timeout)
        rc = OK
        try:
            if held:
                rc = loop.read(items, BURST)  # what came meanwhile, without a select
                while rc == OK and not items:
                    left = SELECT_S if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        break
                    rc = loop.wait(left)
                    if rc == OK:
                        rc = loop.read(items, BURST)
                if rc == OK:
                    rc = loop.misc(MISC_S)
        finally:
            loop.give(held)
        if items:
            return items.popleft()
        if held and rc == OK:
            return None  # nothing came within timeout
        # the connection dropped, or the socket was not handed over: the background thread's now
        return self._wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _wait(self, timeout: float | None) -> Message | None:
        try:
            return self.inbound.get(timeout=timeout)
        except queue.Empty:
            return None

    # -- paho callbacks (network thread) --------------------------------------
    def _on_pre_connect(self, client, userdata) -> None:
        self._connacked = False

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connacked = True
        if reason_code.is_failure:
            code = reason_code.value
            msg = f"broker {self.options.broker.url()} refused connection: {reason_code}"
            if code in FATAL_CONNACK:
                self.fatal = msg + " (bad credentials or not authorized; not retrying)"
                log.error(self.fatal)
                client.disconnect()
            else:
                log.warning(msg)
            return
        sock = client.socket()
        if sock is not None:
            # Rounds are request/response: Nagle + delayed ACK would add ~40 ms per hop.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            subs = list(self._subs.items())
        for topic, qos in subs:
            client.subscribe(topic, qos)
        if self.options.birth is not None:
            for topic, payload in self.options.birth():
                client.publish(topic, payload, qos=1, retain=True)
        self._accepted_at = time.monotonic()
        self._attempts_failed = 0
        self.jitter.reset()  # the next loss draws from [0, reconnect_min_s] again
        self.last_error = None
        self.connected.set()
        log.info("connected to %s as %s", self.options.broker.url(), self.options.client_id)
        for hook in self.on_connect_hooks:  # hooks run on the network thread: no waiting
            try:
                hook()
            except Exception:  # a hook must never kill the network thread
                log.exception("on-connect hook failed")
        self.outbox.pump()  # what waited for the broker goes out now

    def _on_connect_fail(self, client, userdata) -> None:
        self._diagnose(client)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if not self._connacked:
            # Dropped before any CONNACK: under TLS 1.3 that is how a refused client certificate shows.
            self._diagnose(client)
        elif self._accepted_at is not None:
            self._count_drop(client, reason_code.is_failure, time.monotonic() - self._accepted_at)
            self._accepted_at = None
        if self.fatal is None and reason_code.is_failure:  # not our own clean disconnect (stop)
            log.warning("disconnected from %s (%s); reconnecting", self.options.broker.url(), reason_code)

    def _on_message(self, client, userdata, msg) -> None:
        topic = msg.topic
        known = self._tap_of  # a new dict whenever the taps change
        if topic in known:
            tap = known[topic]
        else:
            with self._lock:
                tap = self._taps.get(topic)
                if tap is None and self._filter_taps:
                    tap = next((cb for f, cb in self._filter_taps.items() if topic_matches(f, topic)), None)
                if known is self._tap_of:
                    if len(known) >= TAP_CACHE:
                        known.clear()
                    known[topic] = tap
        message = Message(topic, bytes(msg.payload), bool(msg.retain))
        if tap is not None and tap(message) is not False:
            return
        try:
            self.inbound.put_nowait(message)
        except queue.Full:
            self.dropped_inbound += 1
            log.error("inbound queue full (%d); dropped a message on %s", self.inbound.maxsize, msg.topic)


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches the subscription filter ``topic_filter`` (``+``: one level, ``#``: the rest)."""
    return paho.topic_matches_sub(topic_filter, topic)

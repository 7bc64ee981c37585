"""A thin MQTT session over paho-mqtt 2.x, used by devices and the aggregator alike.

Lifecycle, explicitly (after Home Assistant's MQTT client): the Last Will is set
before connecting; every (re)connect re-publishes the birth messages and
re-subscribes from tracked state; paho reconnects with exponential backoff
(capped at ``reconnect_max_s``, forever); every failed attempt is logged at INFO
with its reason (refused, unresolvable, TLS handshake and why); bad credentials
and refused certificates stop the retrying; another client that keeps taking our
client id (a copied device folder, a stolen certificate) makes the session back
off, longer each time, and say so (see ``SessionOptions.takeover_limit``); inbound
messages go to a bounded queue that the owner drains on its own thread, so slow
work never blocks the network loop; outbound ones go through a bounded outbox
(``ioft_protocol.outbox``) that holds them while the broker is away, so a publish
never raises for a lost connection.

The wire protocol is MQTT 3.1.1 so the session also works against embedded
brokers that speak nothing newer (amqtt).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import paho.mqtt.client as paho

from ioft_protocol.outbox import Outbox, Ticket

log = logging.getLogger(__name__)

#: CONNACK codes after which retrying cannot help (3.1.1 codes 4, 5; 5.0 codes 134, 135).
_FATAL_CONNACK = {4, 5, 134, 135}
#: TLS alerts by which a broker refuses our client certificate (none, another CA's, expired, ...).
_CERT_REFUSED = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    "TLSV1_ALERT_UNKNOWN_CA",
    "SSLV3_ALERT_BAD_CERTIFICATE",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    "SSLV3_ALERT_CERTIFICATE_REVOKED",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    "TLSV1_ALERT_ACCESS_DENIED",
}


class MqttError(RuntimeError):
    """The broker could not be reached or refused us; the message says which."""


@dataclass(frozen=True)
class TlsConfig:
    """``[tls]``: the fleet CA that signed the broker's certificate, and this client's certificate
    and key (mutual TLS; both or neither: with neither, a username and password log in).
    ``cloud-aggregator fleet init`` writes these.  One type for both sides' TOML and the session."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("give cert_file and key_file together (or neither, for password login)")


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is: ``mqtt://host:port`` (plaintext) or ``mqtts://host:port`` (TLS)."""

    host: str
    port: int
    tls: bool

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        parsed = urlparse(url)
        if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
            raise ValueError(f"broker URL {url!r} must look like mqtt://host:port or mqtts://host:port")
        tls = parsed.scheme == "mqtts"
        return cls(parsed.hostname, parsed.port or (8883 if tls else 1883), tls)

    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


#: Topics whose tap (or its absence) a session remembers at most (a fleet's device topics).
TAP_CACHE = 1 << 16
#: How long a probe of a failed attempt waits for the broker's TCP and TLS answers.
_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    retain: bool


class Inbound:
    """The session's inbound messages: a bounded FIFO that the network thread appends to and the
    owner pops from, with the interface of the ``queue.Queue`` it replaces (``put_nowait``, ``get``,
    ``get_nowait``, ``empty``, ``full``, ``qsize``, ``maxsize``; ``queue``: the deque itself).

    A ``queue.Queue`` takes a lock and notifies a condition on every put and every get: a
    message costs two lock round trips and, with the owner waiting, a wake-up each.  Here a put is a
    deque append, a get a pop (both atomic in CPython), and the network thread rings the owner's bell
    only when the owner went to sleep on an empty queue: an owner busy with a batch takes whatever
    arrived meanwhile with no wake-up at all, one wake-up per batch.  One owner reads it at a time
    (``MqttFleet``'s pump; every other session has one reader).
    """

    def __init__(self, maxsize: int = 0) -> None:
        self.maxsize = maxsize
        self.queue: deque[Message] = deque()
        # The owner sleeps on a plain lock that the network thread releases (C-level, no Condition),
        # and only when the owner said it sleeps: a busy owner costs the network thread an append.
        self._bell = threading.Lock()
        self._bell.acquire()
        self._sleeping = False
        #: Times an owner found it empty and slept until a message came (one per batch, not per message).
        self.wakeups = 0

    def qsize(self) -> int:
        return len(self.queue)

    def empty(self) -> bool:
        return not self.queue

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self.queue)

    def put_nowait(self, msg: Message) -> None:
        if 0 < self.maxsize <= len(self.queue):
            raise queue.Full
        self.queue.append(msg)
        # After the append: an owner that said it sleeps after this look finds the message itself.
        if self._sleeping:
            self._sleeping = False
            with contextlib.suppress(RuntimeError):  # rung already: a spurious wake-up, looked past
                self._bell.release()

    def get_nowait(self) -> Message:
        try:
            return self.queue.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, block: bool = True, timeout: float | None = None) -> Message:
        """The oldest message, waiting up to ``timeout`` seconds (``None``: forever) for one."""
        items = self.queue
        if items or not block:
            return self.get_nowait()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._sleeping = True
            if items:  # came between the look above and saying so
                self._sleeping = False
                return items.popleft()
            left = -1 if deadline is None else deadline - time.monotonic()
            if deadline is not None and left <= 0:
                self._sleeping = False
                raise queue.Empty
            self._bell.acquire(timeout=left)
            self._sleeping = False
            if items:
                self.wakeups += 1
                return items.popleft()


@dataclass(frozen=True)
class SessionOptions:
    """Everything a session needs to connect.

    ``birth`` returns ``(topic, payload)`` pairs published retained on every connect
    (called on the network thread: it must not block);
    ``will`` is published by the broker, retained, if we vanish without a clean disconnect.
    ``takeover_limit`` connections in a row that the broker closes within ``takeover_window_s``
    of accepting them mean another client holds our client id (MQTT 3.1.1: the broker drops
    the older connection when one with the same id connects); the session then waits
    ``takeover_backoff_s`` before its next attempt, doubling up to ``takeover_backoff_max_s``
    while the takeovers go on, instead of knocking the other one off every second.  It never
    gives up: a thief with a copied certificate must not silence the real device.
    ``outbound_limit`` messages wait at most for the broker (the oldest is dropped), and
    ``outbound_in_flight`` at most are handed to paho unacknowledged (``ioft_protocol.outbox``).
    """

    broker: BrokerAddress
    client_id: str
    username: str | None = None
    password: str | None = None
    tls: TlsConfig | None = None
    allow_plaintext: bool = True
    keepalive: int = 15
    clean_session: bool = True
    will: tuple[str, bytes] | None = None
    birth: Callable[[], list[tuple[str, bytes]]] | None = None
    inbound_limit: int = 10_000
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 10.0
    takeover_limit: int = 3
    takeover_window_s: float = 30.0
    takeover_backoff_s: float = 5.0
    takeover_backoff_max_s: float = 300.0
    outbound_limit: int = 10_000
    outbound_in_flight: int = 1_000
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_login(cls, login: BrokerLogin, client_id: str, **options: Any) -> SessionOptions:
        """Options from a config's broker login (``device.toml``, ``aggregator.toml``) plus ``options``."""
        return cls(
            broker=BrokerAddress.parse(login.broker),
            client_id=client_id,
            username=login.username,
            password=login.password,
            tls=login.tls,
            allow_plaintext=login.allow_plaintext,
            **options,
        )


class BrokerLogin(Protocol):
    """How a config names its broker and credentials (both sides' TOML have these fields)."""

    @property
    def broker(self) -> str: ...
    @property
    def username(self) -> str | None: ...
    @property
    def password(self) -> str | None: ...
    @property
    def tls(self) -> TlsConfig | None: ...
    @property
    def allow_plaintext(self) -> bool: ...


def check_options(options: SessionOptions) -> ssl.SSLContext | None:
    """What a session refuses before it connects, checked without a client; the TLS context, if any.

    Raises
    ------
    MqttError
        A plaintext URL without ``allow_plaintext``, a TLS URL without a CA, TLS files with a
        plaintext URL, or TLS files that do not load.
    """
    if options.tls is None and not options.broker.tls and not options.allow_plaintext:
        raise MqttError(
            f"refusing plaintext broker {options.broker.url()}: use mqtts:// with a CA, "
            "or set allow_plaintext (tests and loopback demos only)"
        )
    if options.broker.tls and options.tls is None:
        raise MqttError(f"{options.broker.url()} needs TLS options (at least the fleet CA file)")
    if options.tls is not None and not options.broker.tls:
        # paho would quietly speak TLS to an mqtt:// URL; say what is meant instead.
        raise MqttError(
            f"TLS is configured but the broker URL {options.broker.url()} is plaintext: "
            f"use mqtts://{options.broker.host}:<tls port>"
        )
    if options.tls is None:
        return None
    tls = options.tls
    files = {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}
    for name, path in files.items():
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise MqttError(
                    f"cannot read TLS {name} {path}: {exc.strerror or exc}; "
                    f"fix [tls] {name} in the config, or put the file there"
                ) from None
    # Verify the broker against the fleet CA and its host name; present our certificate.
    try:
        ctx = ssl.create_default_context(cafile=tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise MqttError(f"TLS ca_file {tls.ca_file} holds no CA certificate (PEM): {exc}") from None
    if tls.cert_file:
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise MqttError(
                f"TLS cert_file {tls.cert_file} and key_file {tls.key_file} are not a certificate and "
                f"its key (PEM, one pair): {exc}"
            ) from None
    return ctx


class MqttSession:
    """One connection to the broker, kept alive across broker restarts."""

    def __init__(self, options: SessionOptions) -> None:
        self.options = options
        self.inbound = Inbound(options.inbound_limit)
        self.dropped_inbound = 0
        self.connected = threading.Event()
        self.fatal: str | None = None
        self._subs: dict[str, int] = {}
        self._lock = threading.Lock()
        self._connacked = False  # this connection attempt got a CONNACK (reset before each attempt)
        self._accepted_at: float | None = None  # when the broker accepted the current connection
        self._short_lived = 0  # connections in a row the broker closed soon after accepting them
        self._attempts_failed = 0  # failed attempts since the last accepted connection
        self._quiet_attempts = False  # a one-shot's start(): failed attempts at DEBUG, reason raised
        #: Why the latest attempt failed (``None`` once connected).
        self.last_error: str | None = None
        #: Connections the broker closed after accepting them (a takeover, a broker restart, ...).
        self.drops = 0
        #: Attempts that failed (refused, unreachable, closed before CONNACK) since the session
        #: started: one after a drop means the broker itself went away (``serve``'s lock check).
        self.failed_attempts = 0
        #: Times another client was found holding our identity, and when last (Unix time).
        self.takeovers = 0
        self.last_takeover: float | None = None
        #: Seconds to wait before the next attempt while another client holds our identity.
        self.takeover_wait_s: float | None = None
        self.outbox = Outbox(
            self._hand, self.connected.is_set, options.outbound_limit, options.outbound_in_flight
        )
        self._taps: dict[str, Callable[[Message], bool | None]] = {}
        self._filter_taps: dict[str, Callable[[Message], bool | None]] = {}
        #: topic -> its tap (``None``: none), found once per topic: matching a filter builds a
        #: paho matcher (~4 µs), which every upload paid while a status filter was tapped.
        self._tap_of: dict[str, Callable[[Message], bool | None] | None] = {}
        self.on_connect_hooks: list[Callable[[], None]] = []
        self._ssl = check_options(options)
        self._client = self._make_client()

    def _make_client(self) -> paho.Client:
        o = self.options
        client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2,
            client_id=o.client_id,
            protocol=paho.MQTTv311,
            clean_session=o.clean_session,
        )
        client.max_queued_messages_set(0)  # unbounded while offline; QoS 1 survives a broker restart
        client.reconnect_delay_set(min_delay=max(1, int(o.reconnect_min_s)), max_delay=int(o.reconnect_max_s))
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
        self._client.loop_start()
        if timeout is not None and not self.wait_connected(timeout):
            self.stop()
            why = f": {self.last_error}" if self.last_error else ""
            raise MqttError(self.fatal or f"no connection to {b.url()} within {timeout:g} s{why}")

    def wait_until_connected(self, stop: threading.Event) -> bool:
        """Block until connected (``True``) or ``stop`` is set (``False``), however long it takes;
        raise ``MqttError`` if the session gives up (bad credentials, refused certificate)."""
        while not stop.is_set():
            if self.fatal is not None:
                raise MqttError(self.fatal)
            if self.connected.wait(0.1):
                return True
        return False

    def tap(self, topic: str, callback: Callable[[Message], bool | None] | None) -> None:
        """Hand messages on ``topic`` to ``callback`` (on the network thread: no blocking) instead of
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

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.fatal is None:
            if self.connected.wait(0.05):
                return True
        return False

    def stop(self, final: tuple[str, bytes] | None = None) -> None:
        """Publish ``final`` (e.g. a retained offline status), then disconnect cleanly."""
        if final is not None and self.connected.is_set():
            try:
                self.publish(final[0], final[1], retain=True, timeout=2.0)
            except MqttError as exc:
                log.warning("final message not delivered: %s", exc)
        self._client.disconnect()
        self._client.loop_stop()
        self.connected.clear()

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
        """Next inbound message, or ``None`` after ``timeout`` seconds."""
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
            if code in _FATAL_CONNACK:
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

    def _count_drop(self, client: paho.Client, by_broker: bool, lasted_s: float) -> None:
        """A connection the broker had accepted has ended: is another client taking our id?"""
        if not by_broker:
            return  # our own disconnect
        self.drops += 1
        o = self.options
        if lasted_s >= o.takeover_window_s:
            self._short_lived = 0
            self._back_off(None)
            return
        self._short_lived += 1
        if self._short_lived < o.takeover_limit or self.fatal is not None:
            return
        self.takeovers += 1
        self.last_takeover = time.time()
        doublings = self._short_lived - o.takeover_limit
        wait_s = min(o.takeover_backoff_max_s, o.takeover_backoff_s * 2 ** min(doublings, 30))
        log.error(
            "the broker %s closed our connection %d times in a row right after accepting it: another "
            "client is connected with our identity (client id %r, or the certificate's name where the "
            "broker uses it as client id); the same device or aggregator is running twice, a device "
            "folder was copied, or its certificate was stolen: stop the other one (revoke the "
            "certificate if it is not yours). Retrying in %g s",
            o.broker.url(),
            self._short_lived,
            o.client_id,
            wait_s,
        )
        self._back_off(wait_s)

    def _back_off(self, wait_s: float | None) -> None:
        """Wait ``wait_s`` before each next attempt (a takeover); ``None``: paho's usual backoff."""
        o = self.options
        self.takeover_wait_s = wait_s
        if wait_s is None:
            self._client.reconnect_delay_set(max(1, int(o.reconnect_min_s)), int(o.reconnect_max_s))
        else:
            self._client.reconnect_delay_set(max(1, int(wait_s)), max(1, int(wait_s)))

    def _diagnose(self, client: paho.Client) -> None:
        """A failed attempt: say why at INFO, and stop retrying where retrying cannot help.

        paho retries every failure alike and keeps the error to itself, so a device pointed at
        a closed port, a mistyped host, the wrong CA or with a revoked certificate would retry
        in silence.  One attempt of our own (TCP, then the TLS handshake with the same context)
        names the reason; certificate failures stop the retrying.
        """
        if self.fatal is not None:
            return
        if self._short_lived:  # the broker is away or refusing, not another client taking our id
            self._short_lived = 0
            self._back_off(None)
        self._attempts_failed += 1
        self.failed_attempts += 1
        reason, fatal = self._probe()
        url = self.options.broker.url()
        if fatal:
            self.fatal = f"TLS to {url} failed: {reason} (not retrying)"
            log.error(self.fatal)
            client.disconnect()  # ends paho's retry loop
            return
        self.last_error = reason
        log.log(
            logging.DEBUG if self._quiet_attempts else logging.INFO,
            "cannot connect to %s: %s (attempt %d; retrying, at most %g s apart)",
            url,
            reason,
            self._attempts_failed,
            self.options.reconnect_max_s,
        )

    def _probe(self) -> tuple[str, bool]:
        """Why connecting fails, and whether that is final: ``(reason, fatal)``."""
        b, tls = self.options.broker, self.options.tls
        try:
            socket.getaddrinfo(b.host, b.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            return f"cannot resolve the host name {b.host!r} ({exc}); check the broker URL", False
        try:
            raw = socket.create_connection((b.host, b.port), timeout=_PROBE_TIMEOUT_S)
        except ConnectionRefusedError:
            return (
                f"connection refused: nothing listens on {b.host} port {b.port} (is the broker running, "
                "and is the port right?)"
            ), False
        except TimeoutError:
            return f"no answer from {b.host} port {b.port} within {_PROBE_TIMEOUT_S:g} s (firewall?)", False
        except OSError as exc:  # unreachable network, ...: the broker may come back
            return f"cannot reach {b.host} port {b.port}: {exc.strerror or exc}", False
        if self._ssl is None:
            raw.close()
            return "the broker took the TCP connection but the MQTT connect failed", False
        with raw:
            try:
                with self._ssl.wrap_socket(raw, server_hostname=b.host) as conn:
                    # TLS 1.3: the broker judges our certificate after our side of the handshake
                    # is done, so its refusal arrives as an alert on the first read.
                    conn.settimeout(1.0)
                    try:
                        conn.recv(1)
                    except TimeoutError:  # the broker waits for our CONNECT: TLS is fine
                        return "the TLS handshake succeeded but the MQTT connect failed", False
            except ssl.SSLCertVerificationError as exc:
                return (
                    f"the broker's certificate is not trusted ({exc.verify_message}); check tls.ca_file "
                    f"({tls.ca_file}) and that {b.host!r} is among the certificate's names"
                ), True
            except (ssl.SSLEOFError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
                # A plaintext MQTT listener reads our ClientHello as a bad packet and drops us.
                return (
                    f"TLS handshake failed: the broker closed the connection ({exc.strerror or exc}); "
                    f"is port {b.port} the broker's TLS listener, not a plaintext one?"
                ), False
            except ssl.SSLError as exc:
                if exc.reason == "SSLV3_ALERT_CERTIFICATE_REVOKED":
                    return (
                        f"the broker refused our client certificate: it was revoked ({exc.reason}; it is in "
                        f"the fleet's CRL). Enrol this device again: on the fleet's machine "
                        f"`cloud-aggregator fleet add-device --dir FLEET --devices {Path(tls.cert_file).stem}`, "
                        "then copy its new device folder here"
                    ), True
                if exc.reason in _CERT_REFUSED:
                    return (
                        f"the broker refused our client certificate ({exc.reason}); check tls.cert_file "
                        f"({tls.cert_file}): it must be signed by the fleet CA (`cloud-aggregator fleet init`)"
                    ), True
                return (
                    f"TLS handshake failed ({exc.reason or exc}); is port {b.port} the broker's TLS listener?"
                ), False
            except OSError as exc:  # closed during the handshake, timed out: the broker may come back
                return f"TLS handshake failed: {exc.strerror or exc}", False
        return "the TLS handshake succeeded but the MQTT connect failed", False

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

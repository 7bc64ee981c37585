"""Why an attempt to reach the broker failed, in words an operator can act on, and whether to retry.

paho retries every failure alike and keeps the error to itself, so a device pointed at a closed
port, a mistyped host, the wrong CA or with a revoked certificate would retry in silence.
:func:`probe` makes one attempt of its own (DNS, TCP, then the TLS handshake with the session's
context) and names the reason; certificate failures are final.

The remedies name ``cloud-aggregator fleet`` commands although this package is shared with the
device: the device is the side that gets refused, and its operator needs the command to run on the
fleet's machine in the same line.  They are words, not imports: the import contracts still hold.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from pathlib import Path

import paho.mqtt.client as paho

from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions, TlsConfig

# The session's own logger: operators filter and raise one name for everything the session says.
log = logging.getLogger("ioft_protocol.mqtt")

#: CONNACK codes after which retrying cannot help (3.1.1 codes 4, 5; 5.0 codes 134, 135).
FATAL_CONNACK = {4, 5, 134, 135}
#: TLS alerts by which a broker refuses our client certificate (none, another CA's, expired, ...).
CERT_REFUSED = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    "TLSV1_ALERT_UNKNOWN_CA",
    "SSLV3_ALERT_BAD_CERTIFICATE",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    "SSLV3_ALERT_CERTIFICATE_REVOKED",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    "TLSV1_ALERT_ACCESS_DENIED",
}


#: How long a probe of a failed attempt waits for the broker's TCP and TLS answers.
PROBE_TIMEOUT_S = 3.0


def probe(broker: BrokerAddress, tls: TlsConfig | None, context: ssl.SSLContext | None) -> tuple[str, bool]:
    """Why connecting to ``broker`` fails, and whether that is final: ``(reason, fatal)``.

    ``context`` is the session's TLS context (``None``: plaintext), ``tls`` the files it came from.
    """
    b = broker
    try:
        socket.getaddrinfo(b.host, b.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return f"cannot resolve the host name {b.host!r} ({exc}); check the broker URL", False
    try:
        raw = socket.create_connection((b.host, b.port), timeout=PROBE_TIMEOUT_S)
    except ConnectionRefusedError:
        return (
            f"connection refused: nothing listens on {b.host} port {b.port} (is the broker running, "
            "and is the port right?)"
        ), False
    except TimeoutError:
        return f"no answer from {b.host} port {b.port} within {PROBE_TIMEOUT_S:g} s (firewall?)", False
    except OSError as exc:  # unreachable network, ...: the broker may come back
        return f"cannot reach {b.host} port {b.port}: {exc.strerror or exc}", False
    if context is None:
        raw.close()
        return "the broker took the TCP connection but the MQTT connect failed", False
    return _handshake(raw, context, b, tls)


def _handshake(
    raw: socket.socket, context: ssl.SSLContext, b: BrokerAddress, tls: TlsConfig
) -> tuple[str, bool]:
    """:func:`probe`'s TLS step over the connected socket ``raw`` (closed on return)."""
    with raw:
        try:
            with context.wrap_socket(raw, server_hostname=b.host) as conn:
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
            if exc.reason in CERT_REFUSED:
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


class AttemptWatch:
    """What :class:`~ioft_protocol.mqtt.MqttSession` makes of failed attempts and dropped connections.

    The session's counters and its reaction to them: why each attempt failed (:func:`probe`), when
    to stop retrying, and when the broker's drops mean another client holds our identity.  Mixed
    into the session, whose ``options``, ``fatal`` and ``_ssl`` it reads.
    """

    options: SessionOptions
    fatal: str | None
    _ssl: ssl.SSLContext | None

    def _watch_init(self) -> None:
        """The counters, before the first attempt (the session calls it from its ``__init__``)."""
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
        """Wait at least ``wait_s`` before each next attempt (a takeover: the floor of the session's
        jittered delays, ``MqttSession.backoff``); ``None``: the delays alone."""
        self.takeover_wait_s = wait_s

    def _diagnose(self, client: paho.Client) -> None:
        """A failed attempt: say why at INFO (:func:`probe`), and stop retrying where retrying cannot help."""
        if self.fatal is not None:
            return
        if self._short_lived:  # the broker is away or refusing, not another client taking our id
            self._short_lived = 0
            self._back_off(None)
        self._attempts_failed += 1
        self.failed_attempts += 1
        reason, fatal = probe(self.options.broker, self.options.tls, self._ssl)
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

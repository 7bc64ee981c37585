"""What an MQTT session needs to connect: the broker's address, the login, TLS files, the options.

Plain data, shared by both sides' TOML (``device.toml``, ``aggregator.toml``) and the session
(:mod:`ioft_protocol.mqtt`); nothing here opens a connection or imports paho.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlparse


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

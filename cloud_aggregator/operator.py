"""How the operator's commands log in: ``console``, ``fleet status``, ``push`` and ``rollout``.

``fleet init`` gives the operator a listener of its own (``fleet_layout.mosquitto_conf_text``)
where each session keeps the client id it asks for, so every session here asks for one of its
own (:func:`operator_client_id`): any number of consoles and commands run side by side.  On the
devices' listener the broker makes the login's name the client id, so a command holding the
aggregator's login would knock ``serve`` off the broker: :func:`refuse_aggregator_login`
refuses that login before anything connects.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.fleet.layout import AGGREGATOR
from ioft_protocol.config import ConfigError, build, load_toml
from ioft_protocol.mqtt import MqttSession, SessionOptions

#: Prefix of an aggregator worker's login (``fleet_layout.worker_identity``): the aggregator's too.
WORKER_PREFIX = "worker."


def operator_client_id(role: str) -> str:
    """A client id no other session holds: the role, this process and a random tag (two machines
    may run the same pid).  The dots keep it out of the devices' id space (``[a-z0-9][a-z0-9_-]*``),
    whose ids on the devices' listener are their names."""
    return f"operator.{role}.{os.getpid()}.{secrets.token_hex(4)}"


def login_identity(cfg: AggregatorConfig) -> str | None:
    """The name the broker knows this login by: its username, else its certificate's CN
    (``None``: neither, or a certificate that does not load; the session's own checks say why)."""
    if cfg.username:
        return cfg.username
    if cfg.tls is None or not cfg.tls.cert_file:
        return None
    try:
        cert = x509.load_pem_x509_certificate(Path(cfg.tls.cert_file).read_bytes())
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except (OSError, ValueError):
        return None
    return str(names[0].value) if names else None


def refuse_aggregator_login(cfg: AggregatorConfig, source: str) -> None:
    """Refuse the aggregator's (or one of its workers') login for an operator command.

    Raises
    ------
    ConfigError
        Naming the identity and the operator's TOML to use instead.
    """
    who = login_identity(cfg)
    if who == AGGREGATOR or (who or "").startswith(WORKER_PREFIX):
        raise ConfigError(
            source,
            [
                f"this is the aggregator's login ({who}): the broker gives every session of it serve's "
                "client id, so this command would knock serve off the broker; use the operator's: "
                "--config FLEET/operator/operator.toml"
            ],
        )


def operator_config(args: argparse.Namespace, *, connects: bool = True) -> AggregatorConfig:
    """The ``--config`` TOML as an operator command sees it (``ConfigError`` if invalid, or, for a
    command that ``connects``, the aggregator's own login), with ``--broker``/``--fleet``/
    ``--allow-plaintext``/``--state-dir`` overriding."""
    source = str(args.config or "command line")
    raw = load_toml(args.config) if args.config else {}
    raw.pop("task", None)  # the specs are the aggregator's business (and in its store)
    raw.pop("model", None)  # the operator's [model] public_key: read by push.fleet_public_key
    if args.broker:
        raw["broker"] = args.broker
    if args.fleet:
        raw["fleet"] = args.fleet
    if args.allow_plaintext:
        raw["allow_plaintext"] = True
    if getattr(args, "state_dir", None):
        raw["state_dir"] = str(args.state_dir)
    cfg = build(AggregatorConfig, raw, source)
    if connects:
        refuse_aggregator_login(cfg, source)
    return cfg


def operator_session(args: argparse.Namespace, role: str) -> tuple[MqttSession, str]:
    """A connected session for an operator command, with a client id of its own; and the fleet."""
    cfg = operator_config(args)
    session = MqttSession(SessionOptions.for_login(cfg, operator_client_id(role)))
    session.start(timeout=8.0)  # a one-shot: fail in one line, naming the last attempt's reason
    return session, cfg.fleet


def add_session_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        help="the operator's TOML (FLEET/operator/operator.toml: broker, fleet, login, the aggregator's state_dir)",
    )
    p.add_argument("--broker", help="mqtt://host:port or mqtts://host:port")
    p.add_argument("--fleet", help="fleet id")
    p.add_argument("--allow-plaintext", action="store_true", help="accept an unencrypted broker (loopback)")

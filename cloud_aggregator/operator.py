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
from ioft_protocol.cli import flags_over_toml
from ioft_protocol.config import ConfigError, build, load_toml
from ioft_protocol.mqtt import MqttSession, SessionOptions

#: The aggregator's login (and its folder of a ``fleet init`` fleet), reserved among device ids.
AGGREGATOR = "aggregator"
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
    if connects and args.config is None and not args.broker:  # the default broker is plaintext: refused
        raise ConfigError(
            source,
            ["no --config: pass --config operator.toml (fleet init wrote it in <fleet folder>/operator/)"],
        )
    raw = load_toml(args.config) if args.config else {}
    raw.pop("task", None)  # the specs are the aggregator's business (and in its store)
    raw.pop("model", None)  # the operator's [model] public_key: read by push.fleet_public_key
    flags_over_toml(raw, args, "broker", "fleet", "allow_plaintext", "state_dir")
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


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except where there is none (``None``, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def fleet_root_of(config: str | Path | None) -> Path | None:
    """The ``fleet init`` folder a config file of it sits in (``<root>/operator/operator.toml``,
    ``<root>/aggregator/aggregator.toml``); ``None`` for a config kept elsewhere."""
    if config is None:
        return None
    root = Path(config).resolve().parent.parent
    return root if (root / "ca" / "issued.tsv").is_file() else None


def revoked_devices(root: str | Path) -> set[str]:
    """Devices whose every certificate the fleet's CA issued them is in its CRL and that are no
    longer enrolled (``revoke-device``); ``set()`` where ``root`` holds no such record.
    A password fleet keeps no record of who was revoked."""
    root = Path(root)
    issued, crl = root / "ca" / "issued.tsv", root / "broker" / "crl.pem"
    try:
        rows = [line.split("\t") for line in issued.read_text().splitlines() if line.count("\t") == 2]
        revoked = revoked_serials(crl.read_bytes())
    except (OSError, ValueError):
        return set()
    serials: dict[str, set[int]] = {}
    for serial, name, _ in rows:
        try:
            serials.setdefault(name, set()).add(int(serial, 16))
        except ValueError:
            continue
    return {d for d, mine in serials.items() if mine <= revoked and not (root / "devices" / d).is_dir()}


def revoked_serials(crl_pem: bytes) -> set[int]:
    """The serial numbers a CRL lists."""
    return {r.serial_number for r in x509.load_pem_x509_crl(crl_pem)}

"""How the operator's commands log in: ``console``, ``fleet status``, ``push`` and ``rollout``.

``fleet init`` gives the operator a listener of its own (``fleet.broker_conf.mosquitto_conf_text``)
where the login is the client id, and sixteen logins, ``operator.1`` .. ``operator.16``, one
password: each session claims a free one of the first fifteen (:func:`claim_operator_login`), so up
to fifteen consoles and commands of a machine run side by side, ``operator.16`` is left to a hand-run
client (``mosquitto_sub``), and none can take a device's client id (MQTT would
disconnect the device).  A fleet from before those logins keeps ``operator`` and a client id per
session (:func:`operator_client_id`).  On the
devices' listener the broker makes the login's name the client id, so a command holding the
aggregator's login would knock ``serve`` off the broker: :func:`refuse_aggregator_login`
refuses that login before anything connects.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import os
import secrets
import stat
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from cloud_aggregator.config import AggregatorConfig
from ioft_protocol.cli import flags_over_toml
from ioft_protocol.config import ConfigError, build, load_toml
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import BrokerLogin, SessionOptions

#: The aggregator's login (and its folder of a ``fleet init`` fleet), reserved among device ids.
AGGREGATOR = "aggregator"
#: Prefix of an aggregator worker's login (``fleet_layout.worker_identity``): the aggregator's too.
WORKER_PREFIX = "worker."


#: The operator's login as its TOML names it; on its listener each session logs in as one of
#: ``operator.1`` .. ``operator.<OPERATOR_SLOTS>`` instead (:func:`claim_operator_login`).
OPERATOR = "operator"
#: The operator listener's logins, ``operator.1`` .. ``operator.<OPERATOR_SLOTS>``.
OPERATOR_SLOTS = 16
#: The login left to a hand-run client (``mosquitto_sub``, the guides' watching commands): the tools
#: never claim it, so neither knocks the other off the broker (the login is the client id there).
HAND_RUN_SLOT = OPERATOR_SLOTS
#: How many operator sessions (consoles, ``fleet status``, ``push``...) one machine runs at once.
TOOL_SLOTS = OPERATOR_SLOTS - 1
#: ``operator.toml``'s username in a fleet whose operator's listener has those logins: "one of them".
#: A fleet from before them says ``operator`` and keeps it (its password file knows no other).
OPERATOR_LOGIN = f"{OPERATOR}.*"


def operator_slot(k: int) -> str:
    """The ``k``-th login of the operator's listener (1-based): its client id there too."""
    return f"{OPERATOR}.{k}"


class OperatorSlot:
    """One of the operator's listener's logins, held by this process (an ``flock`` on a file in
    the temp folder, released when the process ends) so two sessions of one machine never share it."""

    def __init__(self, key: str) -> None:
        folder = Path(tempfile.gettempdir()) / f"ioft-operator-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # someone else's, in a shared /tmp
            raise ConfigError("operator", [f"{folder} is not a folder of this user's: remove it"])
        # Start at a random login: two machines' first sessions rarely pick the same one.
        first = secrets.randbelow(TOOL_SLOTS)
        for i in range(TOOL_SLOTS):
            k = (first + i) % TOOL_SLOTS + 1  # never HAND_RUN_SLOT
            fh = (folder / f"{key}-{k}.lock").open("a")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                fh.close()
                continue
            self.k, self._fh = k, fh
            return
        raise ConfigError(
            "operator",
            [f"{TOOL_SLOTS} operator sessions already run on this machine: stop one (console, fleet status)"],
        )

    @property
    def login(self) -> str:
        return operator_slot(self.k)


#: The slots this process's one-shot commands hold (released at exit with the process's files).
_HELD: list[OperatorSlot] = []


def claim_operator_login(login: BrokerLogin, role: str) -> tuple[SessionOptions, OperatorSlot | None]:
    """Session options for an operator command: the operator's login (username ``operator.*``) becomes
    a free ``operator.<k>`` of this machine, which the listener makes the client id too; any other
    login keeps its username and gets :func:`operator_client_id`.  Keep the slot until the session ends."""
    if login.username != OPERATOR_LOGIN:
        return SessionOptions.for_login(login, operator_client_id(role)), None
    key = hashlib.sha256(login.broker.encode()).hexdigest()[:12]
    slot = OperatorSlot(key)
    options = dataclasses.replace(SessionOptions.for_login(login, slot.login), username=slot.login)
    return options, slot


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
    options, slot = claim_operator_login(cfg, role)
    if slot is not None:
        _HELD.append(slot)  # a one-shot command: held until the process ends
    session = MqttSession(options)
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

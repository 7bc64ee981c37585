"""``cloud-aggregator fleet init``: a fleet's credentials, broker config and ACL, in one folder.

What it writes (``DIR``)::

    ca/ca.crt, ca/ca.key          the fleet CA (EC P-256); keep ca.key off the broker and the devices
    ca/issued.tsv                 every certificate the CA issued: serial, name, expiry
    broker/mosquitto.conf         a TLS listener, allow_anonymous false, the ACL, the CRL (or password file)
    broker/server.crt, .key       the broker's certificate: SANs for every --host
    broker/acl                    who may read and write which topic (see ``acl_text``)
    broker/crl.pem                (--auth certs) the revoked client certificates
    broker/passwd                 (--auth passwords) PBKDF2-SHA512 hashes in mosquitto 2's format
    broker/operator.passwd        (--auth certs) the operator's password: its own listener wants it
    aggregator/aggregator.toml    the aggregator's connection settings (add [[task]] tables)
    aggregator/workers/           (--workers K, later ``fleet add-worker``) each aggregator worker's
                                  login: <id>.toml, and worker.<id>.crt/.key (--auth certs)
    operator/operator.toml        for ``console``, ``fleet status``, ``push`` and ``rollout``: their own
                                  identity and listener (--operator-port), and the aggregator's state_dir
    ha/                           Home Assistant's login: ha.crt/.key (or a password), ca.crt and
                                  home-assistant.txt, its MQTT integration's settings
    devices/<id>/                 what goes onto the device, as it is: device.toml, its certificate
                                  and key, ca.crt and fleet.pub (device.toml names them relative to
                                  its own folder, so the folder works wherever it is copied)
    model/fleet.key, fleet.pub    the fleet's Ed25519 model-signing key (``export --key``); keep
                                  fleet.key with the operator, off the broker and the devices
    systemd/                      serve's unit and mosquitto's drop-in; each device folder holds its
                                  own units and install.sh (:mod:`cloud_aggregator.fleet.units`)
    plants/<plant>/               (later, ``fleet add-plant``) a plant's own broker, bridged to this
                                  one (:mod:`cloud_aggregator.fleet.plants`)

The broker's secrets (``server.key``, ``passwd``) and its ``data/`` folder belong to
the user mosquitto runs as (``mosquitto``: started as root, the way Debian's service
starts it, it drops to that user before reading them) when this runs as root.

Identities: the username the broker sees is the certificate's CN
(``use_identity_as_username``) or the password file's user; devices are their
device id, the aggregator ``aggregator``, operator commands ``operator``, the aggregator's
workers (``[collect] workers``) ``worker.<id>``, Home Assistant ``ha``: each its own, as the next
sentence requires.  The broker also replaces every client id with that username
(``use_username_as_clientid``): nobody can take over another's client id, which in
MQTT disconnects the holder and, with a persistent session, inherits its queue.  The operator's
commands connect to a listener of their own (``--operator-port``, a fleet certificate and the
operator's password), each session as one of ``operator.1`` .. ``operator.16``, its client id
there too, so consoles and commands run side by side and none can take a device's id.  Both
listeners are on loopback unless ``--bind`` says otherwise (``all``: every interface).

The ACL gives each login the lines under its own ``user`` line and nothing else (no ``pattern``
lines, which mosquitto applies to every login: ``docs/security.md``); ``fleet
add-device`` and ``fleet revoke-device`` rewrite it with the certificate (or password
line) and the CRL, then the broker is reloaded (SIGHUP).

Every file is written into a temporary sibling folder (private keys and passwords
0600 from their creation) which is renamed into place once complete: a crash leaves
no half-made fleet, and an existing folder is replaced only with ``force``.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cloud_aggregator.fleet.acl import acl_text
from cloud_aggregator.fleet.broker_conf import mosquitto_conf_text, mosquitto_password_hash, passwd_lines
from cloud_aggregator.fleet.ca import FleetCA, pem_cert, pem_key
from cloud_aggregator.fleet.files import (
    fsync_tree,
    give_to_broker,
    swap_folder,
    write_file,
)
from cloud_aggregator.fleet.home_assistant import write_home_assistant
from cloud_aggregator.fleet.identity import issue, write_identity, write_worker_identity
from cloud_aggregator.fleet.layout import (
    AGGREGATOR,
    AUTH_MODES,
    DEFAULT_BIND,
    DEFAULT_HOSTS,
    HOME_ASSISTANT,
    OPERATOR,
    RESERVED,
    FleetInitError,
    FleetLayout,
    device_errors,
    worker_identity,
)
from cloud_aggregator.fleet.units import (
    DEFAULT_VENV,
    give_to_aggregator,
    write_device_units,
    write_fleet_units,
)
from export.keys import generate_keypair
from ioft_protocol import codec

__all__ = [
    "AGGREGATOR",
    "OPERATOR",
    "RESERVED",
    "FleetCA",
    "FleetInitError",
    "FleetLayout",
    "acl_text",
    "init_fleet",
    "mosquitto_password_hash",
]

log = logging.getLogger(__name__)


def _check_names(fleet: str, devices: Sequence[str], auth: str) -> tuple[str, ...]:
    errors: list[str] = []
    try:
        codec.check_id("fleet", fleet)
    except codec.WireError as exc:
        errors.append(str(exc))
    if auth not in AUTH_MODES:
        errors.append(f"auth must be one of {', '.join(AUTH_MODES)}, got {auth!r}")
    errors += device_errors(devices)
    if errors:
        raise FleetInitError("cannot initialise the fleet:\n  - " + "\n  - ".join(errors))
    return tuple(devices)


def _check_listeners(
    hosts: Sequence[str], port: int, operator_port: int | None, workers: int
) -> tuple[list[str], int]:
    """The broker's host names (none empty) and the operator's port (default ``port + 1``), checked."""
    if workers < 0:
        raise FleetInitError(f"--workers must be >= 0, got {workers}")
    hosts = [h for h in hosts if h]
    if not hosts:
        raise FleetInitError("name at least one broker host (--host broker.example.com)")
    if not 0 < port < 65536:
        raise FleetInitError(f"port must be in 1..65535, got {port}")
    operator_port = port + 1 if operator_port is None else operator_port
    if not 0 < operator_port < 65536 or operator_port == port:
        raise FleetInitError(
            f"--operator-port must be in 1..65535 and not the devices' --port {port}, got {operator_port}"
        )
    return hosts, operator_port


def _password_logins(auth: str, devices: Sequence[str], worker_ids: Sequence[str]) -> tuple[str, ...]:
    """Who logs in with a password: everyone with ``passwords`` auth; with certificates the operator
    alone (its own listener wants a password as well)."""
    if auth != "passwords":
        return (OPERATOR,)
    return (*devices, AGGREGATOR, OPERATOR, HOME_ASSISTANT, *(worker_identity(w) for w in worker_ids))


def _staging_folder(root: Path, force: bool) -> Path:
    """A new folder beside ``root`` to build the fleet in, renamed into place once whole; refused
    where ``root`` holds something, unless ``force``."""
    if root.exists() and (not root.is_dir() or any(root.iterdir())) and not force:
        raise FleetInitError(f"{root} exists and is not empty; pass --force to replace it")
    try:  # root.parent must take new files
        root.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    except OSError as exc:
        raise FleetInitError(
            f"cannot write {root}: {root.parent} takes no new files ({exc.strerror or exc}); "
            "choose an --out folder you can write"
        ) from None


def _write_fleet(
    layout: FleetLayout,
    staged: FleetLayout,
    hosts: Sequence[str],
    logins: Sequence[str],
    *,
    bind: str | None,
    days: int,
    ca_days: int,
    venv: Path,
) -> None:
    """Write the whole fleet into ``staged`` (its files naming ``layout``'s paths), fsynced."""
    tmp, fleet, auth, devices = staged.root, layout.fleet, layout.auth, layout.devices
    ca = FleetCA.create(fleet, ca_days)
    write_file(staged.ca_cert, pem_cert(ca.cert))
    write_file(tmp / "ca" / "ca.key", pem_key(ca.key), private=True)
    issue(ca, staged, hosts[0], tmp / "broker", server_hosts=hosts, days=days)
    write_file(staged.acl, acl_text(fleet, devices, workers=layout.workers))
    write_file(staged.mosquitto_conf, mosquitto_conf_text(layout, bind=bind))
    if auth == "certs":
        write_file(staged.crl, ca.crl((), days=ca_days))
    (tmp / "broker" / "data").mkdir()
    generate_keypair(staged.signing_key)  # 0600 from creation, like every private key here
    lines = "".join(passwd_lines(n, layout.passwords[n]) for n in logins)
    write_file(staged.passwd if auth == "passwords" else staged.operator_passwd, lines, private=True)
    for name in (*devices, AGGREGATOR, OPERATOR):
        # The operator's listener wants its certificate in both modes.
        issuer = ca if auth == "certs" or name == OPERATOR else None
        write_identity(issuer, layout, name, days=days, staged=staged)
    write_home_assistant(ca if auth == "certs" else None, layout, days=days, staged=staged)
    for w in layout.workers:
        write_worker_identity(ca if auth == "certs" else None, layout, w, days=days, staged=staged)
    for name in devices:
        write_device_units(staged.identity_dir(name), fleet, name, venv)
    write_fleet_units(layout, tmp, venv)
    give_to_broker(staged)
    give_to_aggregator(tmp)
    os.chmod(tmp, 0o755)  # mkdtemp made it 0700; the keys inside are 0600 themselves
    fsync_tree(tmp)


def init_fleet(
    out: str | Path,
    fleet: str,
    devices: Sequence[str],
    *,
    auth: str = "certs",
    hosts: Sequence[str] = DEFAULT_HOSTS,
    port: int = 8883,
    bind: str | None = DEFAULT_BIND,
    force: bool = False,
    days: int = 825,
    ca_days: int = 3650,
    venv: Path = DEFAULT_VENV,
    workers: int = 0,
    operator_port: int | None = None,
) -> FleetLayout:
    """Generate a fleet's CA, certificates or passwords, mosquitto config, ACL and client TOMLs in ``out``.

    ``workers``: K > 0 gives aggregator workers ``w1``..``wK`` (``[collect] workers = K``) their own login.
    ``operator_port``: the operator's own listener (default ``port + 1``), where its commands' sessions
    keep their own client ids (``mosquitto_conf_text``); the operator logs in with a certificate and a password.

    ``hosts`` are the names and addresses devices use to reach the broker (the server
    certificate's SANs; the first one goes into the client configs).  ``bind``: the
    listeners' address (loopback by default; ``"all"`` or ``None``: every interface).  The systemd units run ioft's
    commands from ``venv``.  Raises ``FleetInitError`` if ``out`` exists and is not empty,
    unless ``force``.
    """
    devices = _check_names(fleet, devices, auth)
    hosts, operator_port = _check_listeners(hosts, port, operator_port, workers)
    worker_ids = tuple(f"w{i}" for i in range(1, workers + 1))
    root = Path(out).resolve()
    host = hosts[0]
    url_host = f"[{host}]" if ":" in host else host
    logins = _password_logins(auth, devices, worker_ids)
    passwords = {n: secrets.token_urlsafe(24) for n in logins}
    layout = FleetLayout(root, fleet, auth, f"mqtts://{url_host}:{port}", port, devices, passwords,
                         workers=worker_ids, operator_port=operator_port)  # fmt: skip
    tmp = _staging_folder(root, force)
    try:
        staged = FleetLayout(tmp, fleet, auth, layout.broker_url, port, devices, passwords,
                             workers=worker_ids, operator_port=operator_port)  # fmt: skip
        _write_fleet(layout, staged, hosts, logins, bind=bind, days=days, ca_days=ca_days, venv=venv)
        swap_folder(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("fleet %s: %s auth for %d devices in %s", fleet, auth, len(devices), root)
    return layout

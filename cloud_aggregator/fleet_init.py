"""``cloud-aggregator fleet init``: a fleet's credentials, broker config and ACL, in one folder.

What it writes (``DIR``)::

    ca/ca.crt, ca/ca.key          the fleet CA (EC P-256); keep ca.key off the broker and the devices
    broker/mosquitto.conf         a TLS listener, allow_anonymous false, the ACL (and password file)
    broker/server.crt, .key       the broker's certificate: SANs for every --host
    broker/acl                    who may read and write which topic (see ``acl_text``)
    broker/passwd                 (--auth passwords) PBKDF2-SHA512 hashes in mosquitto 2's format
    aggregator/aggregator.toml    the aggregator's connection settings (add [[task]] tables)
    operator/operator.toml        for ``push`` and ``fleet status`` (their own identity)
    devices/<id>/device.toml      each device's connection settings, its certificate and key,
                                  and ``[model] public_key`` (it installs only models signed below)
    model/fleet.key, fleet.pub    the fleet's Ed25519 model-signing key (``export --key``); keep
                                  fleet.key with the operator, off the broker and the devices

Identities: the username the broker sees is the certificate's CN
(``use_identity_as_username``) or the password file's user; devices are their
device id, the aggregator ``aggregator``, operator commands ``operator``.  The
broker also replaces every client id with that username
(``use_username_as_clientid``): nobody can take over another's client id, which in
MQTT disconnects the holder and, with a persistent session, inherits its queue.

The ACL's device rules are ``pattern`` lines on ``%u``, so enrolling one more device
is one more certificate signed by the CA (or one more password line) and no ACL edit.

Every file is written into a temporary sibling folder (private keys and passwords
0600 from their creation) which is renamed into place once complete: a crash leaves
no half-made fleet, and an existing folder is replaced only with ``force``.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import ipaddress
import logging
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from export.keys import generate_keypair
from ioft_protocol import codec, topics

log = logging.getLogger(__name__)

AGGREGATOR = "aggregator"
OPERATOR = "operator"
RESERVED = (AGGREGATOR, OPERATOR)
AUTH_MODES = ("certs", "passwords")
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
#: mosquitto 2's default PBKDF2 iteration count; the passwords are 192-bit random
#: tokens, so stretching adds nothing but connection latency.
PBKDF2_ITERATIONS = 101
#: Largest MQTT packet the broker accepts: the wire's payload ceiling plus headroom for topic and header.
MAX_PACKET_BYTES = codec.MAX_PAYLOAD_BYTES + 64 * 1024


class FleetInitError(ValueError):
    """Arguments that cannot make a fleet, or a folder that is already one."""


@dataclass(frozen=True)
class FleetLayout:
    """Where ``init_fleet`` put everything (absolute paths)."""

    root: Path
    fleet: str
    auth: str
    broker_url: str
    port: int
    devices: tuple[str, ...]
    passwords: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca" / "ca.crt"

    @property
    def mosquitto_conf(self) -> Path:
        return self.root / "broker" / "mosquitto.conf"

    @property
    def acl(self) -> Path:
        return self.root / "broker" / "acl"

    @property
    def signing_key(self) -> Path:
        """The fleet's Ed25519 private key: ``export --key`` signs models with it."""
        return self.root / "model" / "fleet.key"

    @property
    def model_public_key(self) -> Path:
        return self.signing_key.with_suffix(".pub")

    def identity_dir(self, name: str) -> Path:
        if name in RESERVED:
            return self.root / name
        return self.root / "devices" / name

    def cert(self, name: str) -> Path:
        return self.identity_dir(name) / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.identity_dir(name) / f"{name}.key"

    def toml(self, name: str) -> Path:
        base = {AGGREGATOR: "aggregator.toml", OPERATOR: "operator.toml"}.get(name, "device.toml")
        return self.identity_dir(name) / base


# -- access control --------------------------------------------------------------------------------
def acl_text(fleet: str) -> str:
    """The mosquitto ACL for one fleet.

    Devices get ``pattern`` rules (``%u`` = their certificate CN or username): write
    only their own uplinks and status, read the task broadcasts, their own per-device
    downlinks and the model pushes.  Patterns apply to every user, so ``aggregator``
    and ``operator`` are reserved and can never be device ids.
    """
    p = f"{topics.PROTOCOL}/{codec.check_id('fleet', fleet)}"
    return f"""# ioft fleet {fleet}: generated by `cloud-aggregator fleet init`.
# A user not listed below is a device: %u is its certificate CN (or password-file user).
pattern write {p}/task/+/up/%u
pattern write {p}/status/%u
pattern read {p}/task/+/down
pattern read {p}/task/+/down/%u
pattern read {p}/model/+/manifest
pattern read {p}/model/+/+/chunk/+

# The aggregator: reads every uplink and status, publishes (and reads back) the downlinks.
user {AGGREGATOR}
topic read {p}/task/+/up/+
topic read {p}/status/+
topic readwrite {p}/task/+/down
topic readwrite {p}/task/+/down/+
# Its lock: one aggregator per fleet (cloud_aggregator.singleton).
topic readwrite {p}/aggregator

# Operator commands (`push`, `fleet status`): model pushes and reading the fleet's status.
user {OPERATOR}
topic readwrite {p}/model/#
topic read {p}/status/+
"""


def mosquitto_conf_text(layout: FleetLayout, *, bind: str | None) -> str:
    """One TLS listener; ``require_certificate`` (mutual TLS) or a password file."""
    b = layout.root / "broker"
    listener = f"listener {layout.port}" + (f" {bind}" if bind else "")
    if layout.auth == "certs":
        auth = """require_certificate true
use_identity_as_username true"""
    else:
        auth = f"""require_certificate false
password_file {b / "passwd"}"""
    return f"""# ioft fleet {layout.fleet}: generated by `cloud-aggregator fleet init`.
# Paths are absolute: after moving this folder, edit them (and chown the key, passwd
# and acl files to the user mosquitto runs as: started as root it drops to `mosquitto`).
per_listener_settings false
allow_anonymous false
acl_file {b / "acl"}
persistence true
persistence_location {b / "data"}/
set_tcp_nodelay true
# Bounded: a device cannot make the broker buffer a 256 MB packet.
max_packet_size {MAX_PACKET_BYTES}

{listener}
protocol mqtt
cafile {layout.ca_cert}
certfile {b / "server.crt"}
keyfile {b / "server.key"}
tls_version tlsv1.2
{auth}
# The client id becomes the username: nobody can disconnect another by reusing its id.
use_username_as_clientid true
"""


# -- passwords ---------------------------------------------------------------------------------------
def mosquitto_password_hash(
    password: str, *, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS
) -> str:
    """``$7$<iterations>$<salt b64>$<hash b64>``: mosquitto 2's PBKDF2-SHA512 password-file format
    (what ``mosquitto_passwd -b`` writes; a 12-byte salt, a 64-byte hash)."""
    salt = secrets.token_bytes(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


# -- certificates --------------------------------------------------------------------------------------
def _san(hosts: Sequence[str]) -> list:
    names: list = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


class _Issuer:
    """The fleet CA, with EC P-256 keys throughout.

    mosquitto 2.0.11 on OpenSSL 3 also takes Ed25519 (TLS 1.2 and 1.3, checked by hand),
    but P-256 is what every TLS stack and every hardware key store a Pi may carry
    (TPM 2.0, ATECC608 secure elements) supports.
    """

    def __init__(self, fleet: str, days: int) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ioft"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"ioft fleet {fleet} CA"),
            ]
        )
        now = dt.datetime.now(dt.UTC)
        ski = x509.SubjectKeyIdentifier.from_public_key(self.key.public_key())
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def issue(self, cn: str, *, server_hosts: Sequence[str] = (), days: int) -> tuple[bytes, bytes]:
        """A leaf ``(cert PEM, key PEM)``: a server certificate when ``server_hosts`` is given, else a
        client one.  The extended key usage matters: OpenSSL refuses a server certificate offered as
        a client's, so the broker's key cannot log in as a device named after it."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server_hosts else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
        )
        if server_hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName(_san(server_hosts)), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return _pem_cert(cert), _pem_key(key)


def _pem_cert(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


# -- config snippets -------------------------------------------------------------------------------------
def _toml_str(s: str | Path) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def client_toml(layout: FleetLayout, name: str) -> str:
    """The connection part of a device's (or the aggregator's, or the operator's) TOML."""
    lines = [f"# ioft fleet {layout.fleet}: {name}'s broker connection (`cloud-aggregator fleet init`)."]
    if name not in RESERVED:
        lines.append(f"device = {_toml_str(name)}")
    lines += [f"fleet = {_toml_str(layout.fleet)}", f"broker = {_toml_str(layout.broker_url)}"]
    if name == AGGREGATOR:
        lines.append(
            f"client_id = {_toml_str(AGGREGATOR)}  # the broker uses the username as client id anyway"
        )
    if layout.auth == "passwords":
        lines += [f"username = {_toml_str(name)}", f"password = {_toml_str(layout.passwords[name])}"]
    lines += ["", "[tls]", f"ca_file = {_toml_str(layout.ca_cert)}"]
    if layout.auth == "certs":
        lines += [f"cert_file = {_toml_str(layout.cert(name))}", f"key_file = {_toml_str(layout.key(name))}"]
    if name == AGGREGATOR:
        lines += ["", "# Add [collect] and [[task]] tables here; see README."]
    if name == OPERATOR:
        lines += ["", f"# Models are signed with {layout.signing_key} (export --key)."]
    if name not in RESERVED:
        lines += ["", "[model]", f"public_key = {_toml_str(layout.model_public_key)}"]
    return "\n".join(lines) + "\n"


# -- writing ---------------------------------------------------------------------------------------------
def _write(path: Path, data: bytes | str, *, private: bool = False) -> None:
    """Create ``path`` (0600 from the start when ``private``) and fsync it; the folder is a temp one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(raw)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_tree(root: Path) -> None:
    for folder, _, _ in os.walk(root):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_names(fleet: str, devices: Sequence[str], auth: str) -> tuple[str, ...]:
    errors: list[str] = []
    try:
        codec.check_id("fleet", fleet)
    except codec.WireError as exc:
        errors.append(str(exc))
    if auth not in AUTH_MODES:
        errors.append(f"auth must be one of {', '.join(AUTH_MODES)}, got {auth!r}")
    if not devices:
        errors.append("name at least one device (--devices printer1,printer2)")
    for d in devices:
        try:
            codec.check_id("device", d)
        except codec.WireError as exc:
            errors.append(str(exc))
        if d in RESERVED:
            errors.append(f"device id {d!r} is reserved for the {d}'s own identity; rename the device")
    dupes = sorted({d for d in devices if list(devices).count(d) > 1})
    if dupes:
        errors.append(f"device ids must be unique; repeated: {', '.join(dupes)}")
    if errors:
        raise FleetInitError("cannot initialise the fleet:\n  - " + "\n  - ".join(errors))
    return tuple(devices)


def init_fleet(
    out: str | Path,
    fleet: str,
    devices: Sequence[str],
    *,
    auth: str = "certs",
    hosts: Sequence[str] = DEFAULT_HOSTS,
    port: int = 8883,
    bind: str | None = None,
    force: bool = False,
    days: int = 825,
    ca_days: int = 3650,
) -> FleetLayout:
    """Generate a fleet's CA, certificates or passwords, mosquitto config, ACL and client TOMLs in ``out``.

    ``hosts`` are the names and addresses devices use to reach the broker (the server
    certificate's SANs; the first one goes into the client configs).  ``bind`` limits
    the listener to one address (all interfaces by default).  Raises ``FleetInitError``
    if ``out`` exists and is not empty, unless ``force``.
    """
    devices = _check_names(fleet, devices, auth)
    hosts = [h for h in hosts if h]
    if not hosts:
        raise FleetInitError("name at least one broker host (--host broker.example.com)")
    if not 0 < port < 65536:
        raise FleetInitError(f"port must be in 1..65535, got {port}")
    root = Path(out).resolve()
    if root.exists() and (not root.is_dir() or any(root.iterdir())) and not force:
        raise FleetInitError(f"{root} exists and is not empty; pass --force to replace it")
    host = hosts[0]
    url_host = f"[{host}]" if ":" in host else host
    identities = (*devices, AGGREGATOR, OPERATOR)
    passwords = {n: secrets.token_urlsafe(24) for n in identities} if auth == "passwords" else {}
    layout = FleetLayout(root, fleet, auth, f"mqtts://{url_host}:{port}", port, devices, passwords)

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        staged = FleetLayout(tmp, fleet, auth, layout.broker_url, port, devices, passwords)
        ca = _Issuer(fleet, ca_days)
        _write(staged.ca_cert, _pem_cert(ca.cert))
        _write(tmp / "ca" / "ca.key", _pem_key(ca.key), private=True)
        cert, key = ca.issue(host, server_hosts=hosts, days=days)
        _write(tmp / "broker" / "server.crt", cert)
        _write(tmp / "broker" / "server.key", key, private=True)
        _write(staged.acl, acl_text(fleet))
        _write(staged.mosquitto_conf, mosquitto_conf_text(layout, bind=bind))
        (tmp / "broker" / "data").mkdir()
        generate_keypair(staged.signing_key)  # 0600 from creation, like every private key here
        if auth == "passwords":
            lines = "".join(f"{n}:{mosquitto_password_hash(passwords[n])}\n" for n in identities)
            _write(tmp / "broker" / "passwd", lines, private=True)
        for name in identities:
            if auth == "certs":
                cert, key = ca.issue(name, days=days)
                _write(staged.cert(name), cert)
                _write(staged.key(name), key, private=True)
            # A password in the TOML makes it a secret too.
            _write(staged.toml(name), client_toml(layout, name), private=auth == "passwords")
        os.chmod(tmp, 0o755)  # mkdtemp made it 0700; the keys inside are 0600 themselves
        _fsync_tree(tmp)
        old = None
        if root.exists():
            old = root.with_name(f".{root.name}.old-{secrets.token_hex(4)}")
            root.rename(old)
        tmp.rename(root)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("fleet %s: %s auth for %d devices in %s", fleet, auth, len(devices), root)
    return layout


# -- command line ------------------------------------------------------------------------------------------
def _split(values: Sequence[str] | None) -> list[str]:
    return [v.strip() for value in values or () for v in value.split(",") if v.strip()]


def add_parser(fleet_sub: argparse._SubParsersAction) -> None:
    p = fleet_sub.add_parser(
        "init",
        help="generate a fleet's CA, broker and client certificates (or passwords), mosquitto config and ACL",
    )
    p.add_argument("--fleet", required=True, help="fleet id")
    p.add_argument("--devices", required=True, action="append", help="device ids, comma-separated")
    p.add_argument("--out", required=True, type=Path, help="folder to create (must not exist or be empty)")
    p.add_argument("--auth", choices=AUTH_MODES, default="certs", help="client certificates or passwords")
    p.add_argument(
        "--host",
        action="append",
        help="broker host names/IPs devices connect to, comma-separated or repeated "
        f"(default: {','.join(DEFAULT_HOSTS)}); the first goes into the client configs",
    )
    p.add_argument("--port", type=int, default=8883, help="the TLS listener's port")
    p.add_argument("--bind", help="listen only on this address (default: all interfaces)")
    p.add_argument("--days", type=int, default=825, help="validity of broker and client certificates")
    p.add_argument("--force", action="store_true", help="replace an existing fleet folder")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        layout = init_fleet(
            args.out,
            args.fleet,
            _split(args.devices),
            auth=args.auth,
            hosts=_split(args.host) or DEFAULT_HOSTS,
            port=args.port,
            bind=args.bind,
            force=args.force,
            days=args.days,
        )
    except FleetInitError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"fleet {layout.fleet} ({layout.auth}) in {layout.root}")
    print(f"  broker:     mosquitto -c {layout.mosquitto_conf}   ({layout.broker_url})")
    print(f"  aggregator: {layout.toml(AGGREGATOR)}  (add [[task]] tables)")
    print(f"  operator:   {layout.toml(OPERATOR)}  (push, fleet status --config)")
    for d in layout.devices:
        print(f"  {d}: {layout.identity_dir(d)}/  (edge-trainer --config {layout.toml(d)})")
    print(f"  keep {layout.root / 'ca' / 'ca.key'} offline: it signs new devices")
    print(f"  models: export --key {layout.signing_key}; devices trust {layout.model_public_key}")
    return 0

"""A fleet folder's layout and the files in it: the ACL, mosquitto's config, client TOMLs, passwords.

Shared by ``fleet init`` (:mod:`cloud_aggregator.fleet.init`, which writes a whole
fleet) and ``fleet add-device`` / ``renew-device`` / ``revoke-device``
(:mod:`cloud_aggregator.fleet.devices`, which change one in place).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import pwd
import secrets
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cloud_aggregator.fleet.ca import FleetCA, cert_expiry, cert_name, cert_serial
from cloud_aggregator.operator import AGGREGATOR, OPERATOR_LOGIN, OPERATOR_SLOTS, operator_slot
from cloud_aggregator.worker_login import WORKERS_DIR
from ioft_protocol import codec, topics
from ioft_protocol.config import ConfigError, load_toml
from ioft_protocol.mqtt_options import BrokerAddress
from ioft_protocol.topics import ANY

OPERATOR = "operator"
#: Home Assistant's login (``fleet init`` writes ``ha/``): reads the discovery configs and the state
#: topics its entities show, writes nothing.
HOME_ASSISTANT = "ha"
RESERVED = (AGGREGATOR, OPERATOR, HOME_ASSISTANT)
#: Home Assistant's discovery prefix: the aggregator publishes there, Home Assistant reads it.
DISCOVERY_PREFIX = topics.DISCOVERY_PREFIX
#: Where a listener listens unless ``--bind`` says otherwise: loopback, as the operator guide rehearses.
DEFAULT_BIND = "localhost"
#: ``--bind all``: every interface (mosquitto's listener without an address).
BIND_ALL = "all"
#: Where ``serve`` keeps its store unless told otherwise (``AggregatorConfig.state_dir``'s default).
AGGREGATOR_STATE_DIR = "/var/lib/ioft-aggregator"
#: The user mosquitto drops to when started as root (Debian's package creates it).
BROKER_USER = "mosquitto"
AUTH_MODES = ("certs", "passwords")
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
#: mosquitto 2's default PBKDF2 iteration count; the passwords are 192-bit random
#: tokens, so stretching adds nothing but connection latency.
PBKDF2_ITERATIONS = 101
#: Largest MQTT packet the broker accepts: the wire's payload ceiling plus headroom for topic and header.
MAX_PACKET_BYTES = codec.MAX_PAYLOAD_BYTES + 64 * 1024


def add_listener_args(
    p: argparse.ArgumentParser, whose: str, first_goes_into: str, bind: str | None = DEFAULT_BIND
) -> None:
    """``--host``, ``--port`` and ``--bind`` of a TLS listener (the fleet's broker or a plant's);
    ``bind``: ``--bind``'s default (``None``: every interface)."""
    p.add_argument(
        "--host",
        action="append",
        default=None,
        help=f"{whose} host names/IPs devices connect to, comma-separated or repeated "
        f"(none given: {','.join(DEFAULT_HOSTS)}); the first goes into {first_goes_into}",
    )
    p.add_argument("--port", type=int, default=8883, help=f"{whose} TLS listener's port")
    p.add_argument(
        "--bind",
        default=bind,
        help=f"the address it listens on ({BIND_ALL!r}: every interface)"
        + ("; loopback unless told" if bind else ""),
    )


def listener_line(port: int, bind: str | None) -> str:
    """mosquitto's ``listener`` line: on ``bind`` (``None``, "" or ``BIND_ALL``: every interface)."""
    return f"listener {port}" + ("" if bind in (None, "", BIND_ALL) else f" {bind}")


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
    #: Device id -> the broker URL of the plant it belongs to (``fleet add-plant``); others use ``broker_url``.
    plant_brokers: dict[str, str] = field(default_factory=dict)
    #: The aggregator's workers with their own login (``fleet init --workers``, ``fleet add-worker``).
    workers: tuple[str, ...] = ()
    #: The operator's own listener (``fleet init --operator-port``; 0: none, a fleet from before it).
    operator_port: int = 0

    @property
    def operator_url(self) -> str:
        """Where the operator's commands connect: its own listener (on the devices' one without it)."""
        if not self.operator_port:
            return self.broker_url
        return f"{self.broker_url.rsplit(':', 1)[0]}:{self.operator_port}"

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca" / "ca.crt"

    @property
    def issued(self) -> Path:
        """``serial<TAB>name<TAB>expiry`` per certificate the CA issued: what ``revoke-device`` revokes."""
        return self.root / "ca" / "issued.tsv"

    @property
    def crl(self) -> Path:
        return self.root / "broker" / "crl.pem"

    @property
    def passwd(self) -> Path:
        return self.root / "broker" / "passwd"

    @property
    def operator_passwd(self) -> Path:
        """A certificate fleet's password file: the operator's password only (its listener's login)."""
        return self.root / "broker" / "operator.passwd"

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

    def device_ca(self, name: str) -> Path:
        """The CA certificate's copy in a device's folder."""
        return self.identity_dir(name) / "ca.crt"

    def device_model_key(self, name: str) -> Path:
        """The fleet's model public key's copy in a device's folder."""
        return self.identity_dir(name) / "fleet.pub"

    @property
    def workers_dir(self) -> Path:
        """``aggregator/workers/``: each aggregator worker's login (``<id>.toml``) and certificate."""
        return self.root / AGGREGATOR / WORKERS_DIR

    def worker_login(self, worker: str) -> Path:
        """``aggregator/workers/<id>.toml``: what ``cloud-aggregator worker --id <id>`` logs in with."""
        return self.workers_dir / f"{worker}.toml"


def worker_identity(worker: str) -> str:
    """An aggregator worker's certificate CN (or password-file user): its username and, as the broker
    replaces every client id with the username, its client id.  ``worker.<id>``: a cloud worker
    (``fleet add-worker``) or a plant's partial aggregator (``fleet add-plant --partial-aggregator``,
    its id the plant's).  The dot keeps it out of the device id space (``[a-z0-9][a-z0-9_-]*``)."""
    return f"worker.{codec.check_id('worker', worker)}"


def worker_acl_text(fleet: str, worker: str, what: str) -> str:
    """What aggregator worker ``worker`` (user ``worker.<id>``) may do on the broker it reads uploads from.

    Read: the devices' uploads (it subscribes through the shared group
    ``$share/ioft-agg/.../task/+/up/+``; mosquitto 2.0.11 checks a shared subscription, and each
    message delivered through it, against the plain topic), their statuses (selections are judged
    from them), the round announcements and the coordinator's ``agg/ctl``.  Write: its own batches
    (``agg/batch/<task>/<id>``) and its own state (birth, Last Will, retained: ``agg/worker/<id>``)
    only.  ``what``: the comment line above the stanza.
    """
    w = codec.check_id("worker", worker)
    return f"""
# {what}
user {worker_identity(w)}
topic read {topics.topic_up_all(fleet)}
topic read {topics.topic_status_all(fleet)}
topic read {topics.topic_down_all(fleet)}
topic read {topics.topic_agg_ctl(fleet)}
topic write {topics.topic_agg_batch(fleet, ANY, w)}
topic readwrite {topics.topic_agg_worker(fleet, w)}
"""


# -- access control --------------------------------------------------------------------------------
def device_acl_text(fleet: str, devices: Sequence[str]) -> str:
    """The ACL's device part: each device's own topics and the broadcasts it reads, under its ``user`` line.

    No ``pattern`` lines: mosquitto applies a pattern to every login, so ``write .../status/%u``
    let the aggregator, the operator's certificate or Home Assistant write a status in their own
    name that the aggregator took for a device's.  Here a login gets exactly the lines of its name.
    """
    return "".join(
        f"""
user {codec.check_id("device", d)}
topic write {topics.topic_up(fleet, ANY, d)}
# A task with scaling = "fleet": its feature sums, once (ioft_protocol.feature_stats).
topic write {topics.topic_stats(fleet, ANY, d)}
topic write {topics.topic_status(fleet, d)}
# Its answers to its own new rows and its alerts (edge.serving): only the device writes them.
topic write {topics.topic_answer_all(fleet, d)}
topic write {topics.topic_alert_all(fleet, d)}
# Its Home Assistant discovery configs: serve republishes them, rebuilt, under homeassistant/.
topic write {topics.topic_discovery_all(fleet, d)}
topic read {topics.topic_down_device(fleet, ANY, d)}
# Secure aggregation: its own SecAgg answers out, only what is addressed to it in.
topic write {topics.topic_secagg_up(fleet, ANY, d)}
topic read {topics.topic_secagg_down(fleet, ANY, d)}
# The task broadcasts, the model pushes and the aggregator's roll call.
topic read {topics.topic_down_all(fleet)}
topic read {topics.topic_model_offer_all(fleet)}
topic read {topics.topic_model_chunk_all(fleet)}
topic read {topics.topic_roll_call(fleet)}
topic read {topics.topic_scaling_all(fleet)}
"""
        for d in sorted(devices)
    )


def revoked_acl_text(fleet: str, revoked: Sequence[str]) -> str:
    """A revoked device may write its own status only: ``fleet end-sessions`` takes its live session
    over with a one-off certificate and leaves that status as ``revoked`` (the aggregator then stops
    waiting for it); its own certificate is refused at the handshake once the broker has the CRL."""
    return "".join(
        f"\n# {d}: revoked (`fleet end-sessions` leaves its status as revoked).\n"
        f"user {d}\ntopic write {topics.topic_status(fleet, d)}\n"
        for d in sorted(revoked)
    )


def issued_devices(layout: FleetLayout) -> set[str]:
    """Every device id the fleet's CA ever issued a certificate to (``ca/issued.tsv``; not the
    brokers' own certificates, whose names are host names)."""
    try:
        rows = [line.split("\t") for line in layout.issued.read_text().splitlines()]
    except OSError:
        return set()
    servers = {cert_name(p.read_bytes()) for p in layout.root.glob("**/server.crt")}
    return {r[1] for r in rows if len(r) == 3 and _is_device_id(r[1]) and r[1] not in {*RESERVED, *servers}}


def _is_device_id(name: str) -> bool:
    try:
        codec.check_id("device", name)
    except codec.WireError:
        return False
    return True


def operator_acl_text(fleet: str) -> str:
    """The operator's rights, once per login of its listener (``operator.1`` .. ``operator.N``).

    That listener makes the login its client id, so an operator session can never take a
    device's (or serve's) client id; each session claims a login of its own
    (:func:`cloud_aggregator.operator.claim_operator_login`).  The bare ``operator`` name, which
    its certificate alone carries on the devices' listener, gets no line here: nothing.
    """
    t = topics
    return "".join(
        f"""
user {operator_slot(k)}
topic readwrite {t.topic_models(fleet)}
topic read {t.topic_status_all(fleet)}
topic read {t.topic_answer_all(fleet)}
topic read {t.topic_alert_all(fleet)}
topic write {t.topic_roll_call(fleet)}
{BROKER_BYTES_ACL}"""
        for k in range(1, OPERATOR_SLOTS + 1)
    )


def home_assistant_acl_text(fleet: str, prefix: str = DISCOVERY_PREFIX) -> str:
    """Home Assistant (``ha``): reads the discovery configs and the topics its entities show
    (statuses for availability, answers, alerts); writes nothing, reads no uplink."""
    t = topics
    return f"""
# Home Assistant (`ha`, fleet init's ha/): the discovery configs the aggregator publishes and the
# state its entities show.  Nothing else: no uplinks, no downlinks, no writes.
user {HOME_ASSISTANT}
topic read {prefix}/#
topic read {t.topic_status_all(fleet)}
topic read {t.topic_answer_all(fleet)}
topic read {t.topic_alert_all(fleet)}
"""


def bridge_acl_text(fleet: str, bridge: str, devices: Sequence[str], worker: str = "") -> str:
    """What a plant's bridge may carry on the cloud broker: its devices' uplinks out, their downlinks in.

    With a plant worker (``worker``, its id: ``fleet add-plant --partial-aggregator``) the devices'
    uploads stay at the plant: the bridge writes that worker's batches and state instead, and reads
    the coordinator's control messages (``cloud_aggregator.serve.worker_wire``).
    """
    lines = [f"user {bridge}", f"topic read {topics.topic_down_all(fleet)}",
             f"topic read {topics.topic_model_offer_all(fleet)}",
             f"topic read {topics.topic_model_chunk_all(fleet)}", f"topic read {topics.topic_roll_call(fleet)}",
             f"topic read {topics.topic_scaling_all(fleet)}"]  # fmt: skip
    if worker:
        w = codec.check_id("worker", worker)
        lines += [
            f"topic write {topics.topic_agg_batch(fleet, ANY, w)}",
            f"topic write {topics.topic_agg_worker(fleet, w)}",
            f"topic read {topics.topic_agg_ctl(fleet)}",
        ]
    for d in sorted(devices):
        codec.check_id("device", d)
        lines += [
            *([] if worker else [f"topic write {topics.topic_up(fleet, ANY, d)}"]),
            f"topic write {topics.topic_status(fleet, d)}",
            f"topic write {topics.topic_stats(fleet, ANY, d)}",
            f"topic write {topics.topic_answer_all(fleet, d)}",
            f"topic write {topics.topic_alert_all(fleet, d)}",
            f"topic write {topics.topic_secagg_up(fleet, ANY, d)}",
            f"topic read {topics.topic_down_device(fleet, ANY, d)}",
            f"topic read {topics.topic_secagg_down(fleet, ANY, d)}",
        ]
    return "\n".join(lines) + "\n"


#: The broker's byte counters the console's ``/metrics`` shows (``console_feed.SYS_BYTES``): read
#: only, and only these two (the rest of ``$SYS`` names clients).
BROKER_BYTES_ACL = """# The console (under either login): the broker's byte counters for /metrics.
topic read $SYS/broker/bytes/received
topic read $SYS/broker/bytes/sent
"""


def acl_text(
    fleet: str,
    devices: Sequence[str] = (),
    bridges: dict[str, Sequence[str]] | None = None,
    plant_workers: dict[str, str] | None = None,
    workers: Sequence[str] = (),
    revoked: Sequence[str] = (),
) -> str:
    """The mosquitto ACL for one fleet and its ``devices``; ``bridges``: plant bridge identity -> its devices.

    Every device writes only its own uplinks and status and reads its own per-device
    downlinks and the task broadcasts and model pushes: ``topic`` lines under its own ``user``
    line (its certificate CN or username), so a device missing here (revoked) reads and writes
    nothing, and no other login gets a device's rights (:func:`device_acl_text`).
    ``aggregator``, ``operator`` and ``ha`` are reserved and can never be device ids.  A plant's bridge
    (``fleet add-plant``) writes and reads only its own devices' topics (:func:`bridge_acl_text`);
    ``plant_workers``: bridge identity -> the id of its plant's partial aggregator, if it has one;
    ``workers``: the ids of the aggregator's own workers (``[collect] workers``), each logging in as
    ``worker.<id>`` (:func:`worker_acl_text`).
    """
    partial = plant_workers or {}
    t = topics
    plants = "".join(
        f"\n# Plant bridge {b} (`fleet add-plant`): its devices' topics, nothing else.\n"
        + bridge_acl_text(fleet, b, ds, partial.get(b, ""))
        for b, ds in sorted((bridges or {}).items())
    )
    cloud_workers = "".join(
        worker_acl_text(fleet, w, f"Aggregator worker {w} (`cloud-aggregator worker --id {w}`, serve's [collect] workers).")
        for w in sorted(workers)
    )  # fmt: skip
    return f"""# ioft fleet {fleet}: generated by `cloud-aggregator fleet init` (add-device and
# revoke-device rewrite it). A `user` is a client's certificate CN (or password-file user):
# each login gets the lines under its own name and nothing else.
{device_acl_text(fleet, devices)}{revoked_acl_text(fleet, revoked)}

# The aggregator: reads every uplink and status, publishes (and reads back) the downlinks.
user {AGGREGATOR}
topic read {t.topic_up_all(fleet)}
topic read {t.topic_stats_all(fleet)}
topic readwrite {t.topic_scaling_all(fleet)}
topic read {t.topic_status_all(fleet)}
topic read {t.topic_answer_all(fleet)}
topic read {t.topic_alert_all(fleet)}
topic readwrite {t.topic_down_all(fleet)}
topic readwrite {t.topic_down_device(fleet, ANY, ANY)}
topic read {t.topic_secagg_up(fleet, ANY, ANY)}
topic write {t.topic_secagg_down(fleet, ANY, ANY)}
# Its lock: one aggregator per fleet (cloud_aggregator.serve.singleton).
topic readwrite {t.topic_aggregator_lock(fleet)}
# Its roll call: every device re-publishes its status (ioft_protocol.restate).
topic write {t.topic_roll_call(fleet)}
# As the coordinator of plant workers (`fleet add-plant --partial-aggregator`): their batches and
# states in, its flushes and acknowledgements out (cloud_aggregator.serve.worker_wire).
topic read {t.topic_agg_batch(fleet, ANY, ANY)}
topic read {t.topic_agg_worker(fleet, ANY)}
topic write {t.topic_agg_ctl(fleet)}
# Home Assistant: the devices' discovery configs in, rebuilt under its prefix out
# (cloud_aggregator.serve.home_assistant); no device writes there.
topic read {t.topic_discovery_all(fleet)}
topic readwrite {DISCOVERY_PREFIX}/#
{BROKER_BYTES_ACL}{cloud_workers}
# Operator commands (`push`, `fleet status`, `console`): model pushes and reading the fleet's
# status, under each login of the operator's listener.
{operator_acl_text(fleet)}{home_assistant_acl_text(fleet)}{plants}"""


def mosquitto_conf_text(layout: FleetLayout, *, bind: str | None) -> str:
    """The devices' TLS listener, ``require_certificate`` (mutual TLS, with the fleet's CRL) or a
    password file; and with ``layout.operator_port`` the operator's own listener.

    On the devices' listener the broker replaces every client id with the username (the
    certificate's name), so no device can knock another off; but then every session of one
    identity has one client id, and the operator's commands (consoles, ``fleet status``,
    ``push``) would knock each other off.  The operator's listener admits only the operator: a
    fleet certificate AND the operator's password (mosquitto checks the password file wherever a
    listener does not take the certificate's name as username); a device holds one or the
    other, never both.  There too the login becomes the client id, and the operator has
    ``OPERATOR_SLOTS`` logins (``operator.<k>``, one password), one per session: client ids are
    one namespace across listeners, so a free one would let the operator knock a device off.
    ``bind``: the listeners' address (``BIND_ALL`` or ``None``: every interface).
    """
    b = layout.root / "broker"
    listener = listener_line(layout.port, bind)
    tls = f"""protocol mqtt
cafile {layout.ca_cert}
certfile {b / "server.crt"}
keyfile {b / "server.key"}
tls_version tlsv1.2"""
    crl = f"\ncrlfile {layout.crl}" if layout.auth == "certs" else ""
    if layout.auth == "certs":
        auth = f"""require_certificate true
use_identity_as_username true{crl}"""
        passwd = layout.operator_passwd if layout.operator_port else None
    else:
        auth = "require_certificate false"
        passwd = layout.passwd
    operator = ""
    if layout.operator_port:
        operator = f"""
# The operator's listener (console, fleet status, push, rollout).  Only the operator gets in: a
# fleet certificate and the operator's password, both (devices hold one or the other).  Each
# session logs in as one of operator.1 .. operator.{OPERATOR_SLOTS} (the same password), which
# becomes its client id: several run beside serve and each other, and none can take a device's
# client id (MQTT would disconnect the device).
{listener_line(layout.operator_port, bind)}
{tls}
require_certificate true{crl}
use_username_as_clientid true
"""
    return f"""# ioft fleet {layout.fleet}: generated by `cloud-aggregator fleet init`.
# Paths are absolute: after moving this folder, edit them.  Started as root (as Debian's
# service starts it) mosquitto drops to the `mosquitto` user before it reads the key,
# passwd and acl files and writes data/: fleet init (as root) gave them to that user.
# After add-device / revoke-device: reload it (systemctl reload mosquitto, or kill -HUP).
per_listener_settings false
allow_anonymous false
acl_file {b / "acl"}
{f"password_file {passwd}{chr(10)}" if passwd else ""}persistence true
persistence_location {b / "data"}/
set_tcp_nodelay true
# Bounded: a device cannot make the broker buffer a 256 MB packet.
max_packet_size {MAX_PACKET_BYTES}
# A round's burst queues for the aggregator's client (N uploads and N statuses at once):
# past max_queued_messages (default 1,000) mosquitto drops QoS 1 messages silently.
max_queued_messages 100000

{listener}
{tls}
{auth}
# The client id becomes the username: nobody can disconnect another by reusing its id.
use_username_as_clientid true
{operator}"""


# -- passwords ---------------------------------------------------------------------------------------
def mosquitto_password_hash(
    password: str, *, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS
) -> str:
    """``$7$<iterations>$<salt b64>$<hash b64>``: mosquitto 2's PBKDF2-SHA512 password-file format
    (what ``mosquitto_passwd -b`` writes; a 12-byte salt, a 64-byte hash)."""
    salt = secrets.token_bytes(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


# -- config snippets -------------------------------------------------------------------------------------
def _toml_str(s: str | Path) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def client_toml(layout: FleetLayout, name: str) -> str:
    """The connection part of a device's (or the aggregator's, or the operator's) TOML.

    A device's names its files relative to its own folder (``edge.config`` resolves them
    against the TOML's folder), so ``devices/<id>/`` works wherever it is copied; the
    aggregator's and operator's name theirs by absolute path in the fleet folder.
    """
    device = name not in RESERVED
    lines = [f"# ioft fleet {layout.fleet}: {name}'s broker connection (`cloud-aggregator fleet init`)."]
    if device:
        lines += [
            "# Copy this folder to the device; paths are relative to it.",
            f"# Run: edge-trainer --device {name} --config <this folder>/device.toml",
            f"device = {_toml_str(name)}",
        ]
    broker = layout.operator_url if name == OPERATOR else layout.plant_brokers.get(name, layout.broker_url)
    lines += [f"fleet = {_toml_str(layout.fleet)}", f"broker = {_toml_str(broker)}"]
    if device:
        lines.append(f"state_dir = {_toml_str(f'/var/lib/ioft/{name}')}")
    if name == AGGREGATOR:
        lines += [
            f"client_id = {_toml_str(AGGREGATOR)}  # the broker uses the username as client id anyway",
            f"state_dir = {_toml_str(AGGREGATOR_STATE_DIR)}  # the store; top-level keys go above [tls]",
        ]
    if name == OPERATOR:
        # console, push --canary and rollout read the aggregator's store: where serve keeps it.
        lines.append(f"state_dir = {_toml_str(AGGREGATOR_STATE_DIR)}  # the aggregator's (serve's state_dir)")
    if name in layout.passwords:
        # The operator: one of operator.1 .. operator.N, whichever is free (operator.claim_operator_login).
        user = OPERATOR_LOGIN if name == OPERATOR else name
        lines += [f"username = {_toml_str(user)}", f"password = {_toml_str(layout.passwords[name])}"]
    ca, cert, key = layout.ca_cert, layout.cert(name), layout.key(name)
    if device:
        ca, cert, key = Path(layout.device_ca(name).name), Path(cert.name), Path(key.name)
    lines += ["", "[tls]", f"ca_file = {_toml_str(ca)}"]
    if layout.auth == "certs" or (name == OPERATOR and layout.operator_port):
        lines += [f"cert_file = {_toml_str(cert)}", f"key_file = {_toml_str(key)}"]
    if name == AGGREGATOR:
        lines += ["", "# Add [collect] and [[task]] tables here; see README."]
    if name == OPERATOR:
        lines += [
            "",
            f"# Models are signed with {layout.signing_key} (export --key); push checks them with:",
            "[model]",
            f"public_key = {_toml_str(layout.model_public_key)}",
        ]
    if device:
        lines += ["", "[model]", f"public_key = {_toml_str(layout.device_model_key(name).name)}"]
    return "\n".join(lines) + "\n"


def passwd_lines(name: str, password: str) -> str:
    """``name``'s password-file lines: the operator's once per login of its listener (``operator.<k>``)."""
    users = [operator_slot(k) for k in range(1, OPERATOR_SLOTS + 1)] if name == OPERATOR else [name]
    return "".join(f"{u}:{mosquitto_password_hash(password)}\n" for u in users)


def worker_login_toml(layout: FleetLayout, worker: str) -> str:
    """``aggregator/workers/<id>.toml``: worker ``<id>``'s login, which ``cloud-aggregator worker --config
    aggregator.toml --id <id>`` (and so each worker ``serve`` starts) puts in place of aggregator.toml's;
    everything else (broker, [admission], ...) stays aggregator.toml's.  Absolute paths, like aggregator.toml's."""
    lines = [
        f"# ioft fleet {layout.fleet}: aggregator worker {worker}'s login (`cloud-aggregator fleet add-worker`).",
        f"# `cloud-aggregator worker --config {layout.toml(AGGREGATOR)} --id {worker}` (each worker serve starts",
        "# too) logs in with this instead of aggregator.toml's own login; the rest comes from aggregator.toml.",
    ]
    cn = worker_identity(worker)
    if layout.auth == "passwords":
        lines += [f"username = {_toml_str(cn)}", f"password = {_toml_str(layout.passwords[cn])}"]
    else:
        lines += ["", "[tls]", f"cert_file = {_toml_str(layout.workers_dir / f'{cn}.crt')}",
                  f"key_file = {_toml_str(layout.workers_dir / f'{cn}.key')}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def worker_errors(layout: FleetLayout, workers: Sequence[str]) -> list[str]:
    """What is wrong with adding aggregator workers ``workers`` to ``layout``'s fleet (ids, repeats, taken)."""
    errors: list[str] = []
    if not workers:
        errors.append("name at least one worker (--id w3)")
    for w in workers:
        try:
            codec.check_id("worker", w)
        except codec.WireError as exc:
            errors.append(str(exc))
    dupes = sorted({w for w in workers if list(workers).count(w) > 1})
    if dupes:
        errors.append(f"worker ids must be unique; repeated: {', '.join(dupes)}")
    taken = sorted(set(workers) & set(layout.workers))
    errors += [f"worker {w} exists ({layout.worker_login(w)})" for w in taken]
    plants = {p.worker: p.plant for p in read_plants(layout.root) if p.worker} if layout.root.exists() else {}
    errors += [
        f"worker id {w} is plant {plants[w]}'s partial aggregator; pick another"
        for w in sorted(set(workers) & set(plants))
    ]
    return errors


# -- writing ---------------------------------------------------------------------------------------------
def write_file(path: Path, data: bytes | str, *, private: bool = False) -> None:
    """Create ``path`` (0600 from the start when ``private``) and fsync it; the folder is a temp one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(raw)
        fh.flush()
        os.fsync(fh.fileno())


def replace_file(path: Path, data: bytes | str, *, private: bool = False) -> None:
    """Atomically replace ``path`` (a file the broker reads), keeping its owner."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        write_file(tmp, data, private=private)
        if path.exists() and os.geteuid() == 0:
            st = path.stat()
            os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_tree(root: Path) -> None:
    for folder, _, _ in os.walk(root):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def swap_folder(tmp: Path, final: Path) -> None:
    """Put the written (and fsynced) folder ``tmp`` in place of ``final``: an old ``final`` is
    renamed aside first, so a crash leaves a whole folder under one of the names, never half of one."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{secrets.token_hex(4)}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


def broker_owner(user: str = BROKER_USER) -> tuple[int, int] | None:
    """``(uid, gid)`` of the user mosquitto drops to, when we are root and it exists (else ``None``)."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def unreachable_folder(path: Path) -> Path | None:
    """The first folder above ``path`` that other users cannot enter (mosquitto, once it drops root)."""
    for folder in reversed(Path(path).resolve().parents):
        if not folder.stat().st_mode & stat.S_IXOTH:
            return folder
    return None


def give_to_broker(layout: FleetLayout) -> None:
    """Hand the broker's secrets and its data folder to the user mosquitto runs as (when root)."""
    owner = broker_owner()
    if owner is None:
        return
    b = layout.root / "broker"
    for path in (b / "server.key", layout.passwd, layout.operator_passwd, b / "data"):
        if path.exists():
            os.chown(path, *owner)


def issue(
    ca: FleetCA, layout: FleetLayout, name: str, folder: Path, *, days: int, server_hosts: Sequence[str] = ()
) -> None:
    """Issue ``name``'s certificate and key into ``folder`` and record it in ``ca/issued.tsv``."""
    cert, key = ca.issue(name, server_hosts=server_hosts, days=days)
    stem = "server" if server_hosts else name
    write_file(folder / f"{stem}.crt", cert)
    write_file(folder / f"{stem}.key", key, private=True)
    with layout.issued.open("a") as fh:
        fh.write(f"{cert_serial(cert):x}\t{name}\t{cert_expiry(cert).isoformat()}\n")


def write_identity(
    ca: FleetCA | None,
    layout: FleetLayout,
    name: str,
    *,
    days: int,
    staged: FleetLayout | None = None,
    folder: Path | None = None,
) -> None:
    """Everything ``name`` needs: its certificate and key (``ca``: certificate auth), its TOML (naming
    ``layout``'s paths), and for a device the CA certificate and model key.

    Files go under ``staged`` (a fleet folder being built; default ``layout``), into ``folder``
    (default: ``name``'s identity folder there).
    """
    staged = layout if staged is None else staged
    folder = staged.identity_dir(name) if folder is None else folder
    if ca is not None:
        issue(ca, staged, name, folder, days=days)
    # A password in the TOML makes it a secret too.
    write_file(folder / layout.toml(name).name, client_toml(layout, name), private=name in layout.passwords)
    if name not in RESERVED:
        shutil.copyfile(staged.ca_cert, folder / layout.device_ca(name).name)
        shutil.copyfile(staged.model_public_key, folder / layout.device_model_key(name).name)


def write_worker_identity(
    ca: FleetCA | None,
    layout: FleetLayout,
    worker: str,
    *,
    days: int,
    staged: FleetLayout | None = None,
    folder: Path | None = None,
) -> None:
    """Aggregator worker ``worker``'s certificate and key (``ca``: certificate auth; CN ``worker.<id>``,
    recorded in ``staged``'s ``ca/issued.tsv``) and its login TOML (naming ``layout``'s paths), into
    ``folder`` (default: ``staged``'s ``aggregator/workers/``; ``staged`` defaults to ``layout``).
    A password makes the TOML a secret."""
    staged = layout if staged is None else staged
    folder = staged.workers_dir if folder is None else folder
    if ca is not None:
        issue(ca, staged, worker_identity(worker), folder, days=days)
    login = worker_login_toml(layout, worker)
    write_file(folder / layout.worker_login(worker).name, login, private=layout.auth == "passwords")


def device_errors(devices: Sequence[str]) -> list[str]:
    errors: list[str] = []
    if not devices:
        errors.append("name at least one device (--devices printer1,printer2)")
    for d in devices:
        try:
            codec.check_id("device", d)
        except codec.WireError as exc:
            errors.append(str(exc))
        if d in RESERVED:
            errors.append(f"device id {d!r} is reserved for the fleet's own {d} login; rename the device")
    dupes = sorted({d for d in devices if list(devices).count(d) > 1})
    if dupes:
        errors.append(f"device ids must be unique; repeated: {', '.join(dupes)}")
    return errors


def open_fleet(root: str | Path) -> FleetLayout:
    """The layout of a folder ``init_fleet`` wrote (fleet, broker URL and auth read back from it).

    Raises
    ------
    FleetInitError
        If ``root`` is not a fleet folder.
    """
    root = Path(root).resolve()
    try:
        raw = load_toml(root / AGGREGATOR / "aggregator.toml")
        broker = BrokerAddress.parse(str(raw.get("broker")))
        fleet = codec.check_id("fleet", str(raw.get("fleet")))
    except (ConfigError, ValueError) as exc:
        detail = "; ".join(exc.errors) if isinstance(exc, ConfigError) else str(exc)
        raise FleetInitError(
            f"{root} is not a fleet folder (aggregator/aggregator.toml: {detail}); "
            "give the folder `fleet init --out` wrote"
        ) from None
    auth = "passwords" if (root / "broker" / "passwd").exists() else "certs"
    folder = root / "devices"
    devices = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    brokers = {d: plant.broker for plant in read_plants(root) for d in plant.devices}
    workers = tuple(sorted(p.stem for p in (root / AGGREGATOR / WORKERS_DIR).glob("*.toml")))
    return FleetLayout(root, fleet, auth, str(raw["broker"]), broker.port, tuple(devices),
                       plant_brokers=brokers, workers=workers)  # fmt: skip


@dataclass(frozen=True)
class PlantRecord:
    """``plants/<plant>/plant.toml``: a plant's bridge identity, its broker and the devices it serves."""

    plant: str
    bridge: str
    broker: str
    devices: tuple[str, ...]
    #: The id of the plant's partial aggregator (``cloud-aggregator worker --plant``); "": none.
    worker: str = ""


def read_plants(root: Path) -> list[PlantRecord]:
    """Every plant ``fleet add-plant`` wrote under ``root/plants`` (none: an empty list)."""
    found = []
    for toml in sorted((root / "plants").glob("*/plant.toml")):
        try:
            raw = load_toml(toml)
            found.append(PlantRecord(str(raw["plant"]), str(raw["bridge"]), str(raw["broker"]),
                                     tuple(str(d) for d in raw["devices"]), str(raw.get("worker", ""))))  # fmt: skip
        except (ConfigError, KeyError, TypeError) as exc:
            raise FleetInitError(
                f"{toml} is not a plant record ({exc}); rewrite it: fleet add-plant --force"
            ) from None
    return found


def split_ids(values: Sequence[str] | None) -> list[str]:
    return [v.strip() for value in values or () for v in value.split(",") if v.strip()]


def print_device_lines(layout: FleetLayout, devices: Sequence[str]) -> None:
    for d in devices:
        print(
            f"  {d}: copy {layout.identity_dir(d)}/ to the device, then "
            f"edge-trainer --device {d} --config <copied folder>/device.toml"
        )

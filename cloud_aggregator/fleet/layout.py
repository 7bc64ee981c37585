"""A fleet folder's layout: where each login's files, the CA, the broker's files and the plants live,
and the checks on the names that go in it.  What goes into those files: :mod:`.acl`,
:mod:`.broker_conf`, :mod:`.identity`; how they are written: :mod:`.files`.

Shared by ``fleet init`` (:mod:`cloud_aggregator.fleet.init`, which writes a whole
fleet) and ``fleet add-device`` / ``renew-device`` / ``revoke-device``
(:mod:`cloud_aggregator.fleet.devices`, which change one in place).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cloud_aggregator import REMOVED_IN
from cloud_aggregator.fleet.ca import cert_name
from cloud_aggregator.operator import AGGREGATOR
from cloud_aggregator.worker_login import WORKERS_DIR
from ioft_protocol import codec, topics
from ioft_protocol.config import ConfigError, load_toml
from ioft_protocol.moved import names_moved_out
from ioft_protocol.mqtt_options import BrokerAddress

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


#: Names that left this module for one of their own in the split by job: ``from
#: cloud_aggregator.fleet.layout import acl_text`` (or the old ``cloud_aggregator.fleet_layout``)
#: keeps working, with a ``DeprecationWarning``, until version 0.2.0 (``cloud_aggregator.REMOVED_IN``).
MOVED_OUT = {
    **dict.fromkeys(
        ("BROKER_BYTES_ACL", "acl_text", "bridge_acl_text", "device_acl_text", "home_assistant_acl_text",
         "operator_acl_text", "revoked_acl_text", "worker_acl_text"),
        "cloud_aggregator.fleet.acl",
    ),
    **dict.fromkeys(
        ("MAX_PACKET_BYTES", "PBKDF2_ITERATIONS", "mosquitto_conf_text", "mosquitto_password_hash", "passwd_lines"),
        "cloud_aggregator.fleet.broker_conf",
    ),
    **dict.fromkeys(
        ("client_toml", "issue", "worker_login_toml", "write_identity", "write_worker_identity"),
        "cloud_aggregator.fleet.identity",
    ),
    **dict.fromkeys(
        ("broker_owner", "fsync_tree", "give_to_broker", "replace_file", "swap_folder", "unreachable_folder",
         "write_file"),
        "cloud_aggregator.fleet.files",
    ),
}  # fmt: skip


__getattr__ = names_moved_out(__name__, MOVED_OUT, REMOVED_IN)

"""``cloud-aggregator fleet add-plant``: a plant's own broker, bridged to the fleet's (cloud) broker.

What it writes (``FLEET/plants/<plant>/``, copied to the plant's gateway)::

    mosquitto.conf              the plant listener (TLS, fleet CA, CRL) and the bridge to the cloud
    acl                         the plant's devices' own topics
    server.crt, server.key      the plant broker's certificate: SANs for every --host
    bridge.<plant>.crt, .key    the bridge's client certificate (CN bridge.<plant>)
    ca.crt, crl.pem             copies of the fleet CA and CRL (revoke-device refreshes the CRL)
    plant.toml                  the plant's record: its bridge identity, broker URL and devices
    data/                       the plant broker's persistence (queued uplinks survive its restart)
    systemd/mosquitto.service.d/ioft.conf   Debian's mosquitto.service, on the plant's conf

and with ``--partial-aggregator`` (a plant worker, ``cloud-aggregator worker --plant``, so that one
batch per round, not one upload per device, crosses the bridge)::

    worker.<plant>.crt, .key    the worker's client certificate (CN worker.<plant>; its worker id: <plant>)
    worker.toml                 its connection: the plant broker, TLS with that certificate
    systemd/ioft-plant-worker.service   ``cloud-aggregator worker --plant`` as a Type=notify service

The plant ACL then grants the worker its devices' uploads, statuses, announcements and ``agg/ctl``,
and its own batches and state; the bridge carries those instead of the devices' uploads
(``bridge_topic_lines(partial=True)``), and the cloud ACL lets the bridge write them.

It also points each listed device's ``devices/<id>/device.toml`` at the plant broker, and
grants the bridge identity its devices' topics in the cloud ACL (reload the cloud broker).
Topics do not change: a device sees on the plant broker what it would see on the cloud.
Certificate auth only: the bridge logs in with a certificate the fleet CA issues.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cloud_aggregator.fleet.devices import RELOAD_HINT, load_ca, rewrite_acl
from cloud_aggregator.fleet.layout import (
    DEFAULT_HOSTS,
    FleetInitError,
    FleetLayout,
    PlantRecord,
    add_listener_args,
    broker_owner,
    client_toml,
    fsync_tree,
    issue,
    open_fleet,
    read_plants,
    replace_file,
    split_ids,
    swap_folder,
    worker_identity,
    write_file,
)
from cloud_aggregator.fleet.plant_files import (
    BRIDGE_PROTOCOLS,
    bridge_identity,
    plant_acl_text,
    plant_conf_text,
    plant_dir,
    plant_dropin,
    plant_toml_text,
    worker_toml_text,
)
from cloud_aggregator.fleet.units import MOSQUITTO_DROPIN, PLANT_WORKER_UNIT, plant_worker_unit, venv_of
from cloud_aggregator.operator import DefaultsHelpFormatter
from ioft_protocol import codec
from ioft_protocol.mqtt_options import BrokerAddress


def _errors(layout: FleetLayout, plant: str, devices: Sequence[str], force: bool, partial: bool) -> list[str]:
    errors: list[str] = []
    try:
        codec.check_id("plant", plant)
    except codec.WireError as exc:
        errors.append(str(exc))
    if layout.auth != "certs":
        errors.append(
            "plants need a certificate fleet (fleet init --auth certs): the bridge logs in with one"
        )
    if not devices:
        errors.append("name the plant's devices (--devices printer1,printer2)")
    if partial and plant in layout.workers:  # one worker id space: agg/worker/<id>, agg/batch/+/<id>
        errors.append(f"worker id {plant} is an aggregator worker's ({layout.worker_login(plant)}); "
                      "a plant's partial aggregator takes its plant's id: name the plant otherwise")  # fmt: skip
    errors += [f"{d} is not enrolled (fleet add-device first)" for d in devices if d not in layout.devices]
    for other in read_plants(layout.root):
        if other.plant == plant:
            if not force:
                errors.append(f"plant {plant} exists ({plant_dir(layout, plant)}); --force rewrites it")
            continue
        errors += [f"{d} already belongs to plant {other.plant}" for d in devices if d in other.devices]
    return errors


def _cloud_address(layout: FleetLayout, cloud: str | None) -> str:
    """``host:port`` of the cloud broker for the bridge's ``address`` line."""
    if cloud:
        host, sep, port = cloud.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise FleetInitError(f"--cloud must be HOST:PORT, got {cloud!r}")
        return cloud
    b = BrokerAddress.parse(layout.broker_url)
    return f"{b.host}:{b.port}"


def add_plant(
    root: str | Path,
    plant: str,
    devices: Sequence[str],
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    port: int = 8883,
    bind: str | None = None,
    cloud: str | None = None,
    protocol: str = "mqttv311",
    restart_timeout: tuple[int, int] = (2, 30),
    days: int = 825,
    force: bool = False,
    partial: bool = False,
) -> tuple[FleetLayout, PlantRecord]:
    """Write ``plants/<plant>/`` for ``devices`` (enrolled already), point their TOMLs at it and
    grant its bridge their topics in the cloud ACL; with ``partial``, a plant worker's files too
    (its id is the plant id) and the bridge carries its batches instead of the devices' uploads.

    Raises
    ------
    FleetInitError
        On a bad plant id, a password fleet, devices not enrolled or in another plant, an existing
        plant without ``force``, or bad host, port, cloud address or protocol.
    """
    layout = open_fleet(root)
    devices = tuple(devices)
    errors = _errors(layout, plant, devices, force, partial)
    hosts = [h for h in hosts if h]
    if not hosts:
        errors.append("name at least one plant broker host (--host plant-a.example.com)")
    if not 0 < port < 65536:
        errors.append(f"port must be in 1..65535, got {port}")
    if protocol not in BRIDGE_PROTOCOLS:
        errors.append(f"bridge protocol must be one of {', '.join(BRIDGE_PROTOCOLS)}, got {protocol!r}")
    if not 0 < restart_timeout[0] <= restart_timeout[1]:
        errors.append(f"bridge retry must be BASE,CAP seconds with 0 < BASE <= CAP, got {restart_timeout}")
    if errors:
        raise FleetInitError(f"cannot add plant {plant}:\n  - " + "\n  - ".join(errors))
    address = _cloud_address(layout, cloud)
    url_host = f"[{hosts[0]}]" if ":" in hosts[0] else hosts[0]
    record = PlantRecord(
        plant, bridge_identity(plant), f"mqtts://{url_host}:{port}", devices, plant if partial else ""
    )
    before = next((p for p in read_plants(layout.root) if p.plant == plant), None)
    ca = load_ca(layout)

    final = plant_dir(layout, plant)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{plant}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)
        issue(ca, layout, hosts[0], tmp, server_hosts=hosts, days=days)  # recorded in ca/issued.tsv
        issue(ca, layout, record.bridge, tmp, days=days)
        keys = [tmp / "server.key", tmp / f"{record.bridge}.key"]
        if partial:
            issue(ca, layout, worker_identity(plant), tmp, days=days)
            keys.append(tmp / f"{worker_identity(plant)}.key")
            write_file(tmp / "worker.toml", worker_toml_text(layout, record))
            unit = plant_worker_unit(
                layout.fleet, plant, record.worker, final / "worker.toml", venv_of(layout)
            )
            write_file(tmp / "systemd" / PLANT_WORKER_UNIT, unit)
        shutil.copyfile(layout.ca_cert, tmp / "ca.crt")
        if layout.crl.exists():
            shutil.copyfile(layout.crl, tmp / "crl.pem")
        else:  # an older fleet without a CRL: the plant starts with an empty one
            write_file(tmp / "crl.pem", ca.crl((), days=3650))
        write_file(tmp / "acl", plant_acl_text(layout.fleet, record))
        write_file(tmp / "plant.toml", plant_toml_text(record))
        conf = plant_conf_text(layout, record, port=port, bind=bind, cloud=address, protocol=protocol,
                               restart_timeout=restart_timeout)  # fmt: skip
        write_file(tmp / "mosquitto.conf", conf)
        write_file(tmp / "systemd" / MOSQUITTO_DROPIN, plant_dropin(layout, plant))
        (tmp / "data").mkdir()
        owner = broker_owner()
        if owner is not None:  # mosquitto drops root before reading keys and writing data/
            for path in (*keys, tmp / "data"):
                os.chown(path, *owner)
        fsync_tree(tmp)
        swap_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    new = open_fleet(layout.root)  # now with the plant's devices on its broker
    moved = set(devices) | set(before.devices if before else ())
    for d in sorted(moved & set(new.devices)):
        replace_file(new.toml(d), client_toml(new, d))
    rewrite_acl(new, new.devices)
    return new, record


def _retry(text: str) -> tuple[int, int]:
    try:
        parts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BASE,CAP seconds (e.g. 2,30), got {text!r}") from None
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected BASE,CAP seconds (e.g. 2,30), got {text!r}")
    return parts[0], parts[-1]


def add_parser(fleet_sub: argparse._SubParsersAction) -> None:
    """``fleet add-plant``."""
    p = fleet_sub.add_parser(
        "add-plant",
        help="a plant's own mosquitto (config, ACL, certificates) bridged to the fleet's broker",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--dir", required=True, type=Path, help="the fleet folder (`fleet init --out`)")
    p.add_argument("--plant", required=True, help="plant id (its folder: plants/<plant>/)")
    p.add_argument("--devices", required=True, action="append", help="enrolled device ids, comma-separated")
    add_listener_args(
        p, "the plant broker's", "the devices' TOMLs", bind=None
    )  # the plant's devices reach it
    p.add_argument("--cloud", help="HOST:PORT the bridge dials (none: the fleet's broker URL)")
    p.add_argument("--bridge-protocol", choices=BRIDGE_PROTOCOLS, default="mqttv311",
                   help="MQTT version of the bridge link (mqttv311 works with any cloud broker)")  # fmt: skip
    p.add_argument("--bridge-retry", type=_retry, default=(2, 30), metavar="BASE,CAP",
                   help="seconds between the bridge's reconnect attempts (jittered from BASE up to CAP)")  # fmt: skip
    p.add_argument("--days", type=int, default=825, help="validity of the plant's certificates")
    p.add_argument("--force", action="store_true", help="rewrite an existing plant (new certificates)")
    p.add_argument("--partial-aggregator", action="store_true",
                   help="a plant worker (cloud-aggregator worker --plant) folds the plant's uploads: one "
                   "batch per round crosses the bridge, not one upload per device")  # fmt: skip
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """``fleet add-plant``: write the plant folder and say what to run where."""
    try:
        layout, plant = add_plant(
            args.dir,
            args.plant,
            split_ids(args.devices),
            hosts=split_ids(args.host) or DEFAULT_HOSTS,
            port=args.port,
            bind=args.bind,
            cloud=args.cloud,
            protocol=args.bridge_protocol,
            restart_timeout=args.bridge_retry,
            days=args.days,
            force=args.force,
            partial=args.partial_aggregator,
        )
    except (FleetInitError, OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    d = plant_dir(layout, plant.plant)
    print(f"fleet {layout.fleet}: plant {plant.plant} ({', '.join(plant.devices)}) on {plant.broker}")
    print(f"  plant gateway: copy {d}/ there, then mosquitto -c {d / 'mosquitto.conf'} (or as a service: "
          f"cp -r {d / 'systemd'}/* /etc/systemd/system/)")  # fmt: skip
    print(f"  cloud broker: its ACL now grants {plant.bridge} the plant's topics; {RELOAD_HINT}")
    print(f"  devices: copy devices/<id>/ again (device.toml now names {plant.broker})")
    if plant.worker:
        print(f"  plant worker: cloud-aggregator worker --plant --id {plant.worker} --config {d / 'worker.toml'} "
              f"(or as a service: systemd/{PLANT_WORKER_UNIT})")  # fmt: skip
        print(f'  serve: add plant_workers = ["{plant.worker}"] to [collect] in aggregator.toml')
    return 0

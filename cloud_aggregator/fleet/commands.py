"""The ``fleet`` commands' parsers (``init``, the device commands, ``end-sessions``, then the
plants' and workers'), and ``fleet init``'s command: write the folder, then say what to do with each part."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cloud_aggregator.fleet import devices as fleet_devices
from cloud_aggregator.fleet import plants as fleet_plants
from cloud_aggregator.fleet import workers as fleet_workers
from cloud_aggregator.fleet.files import broker_owner, unreachable_folder
from cloud_aggregator.fleet.init import init_fleet
from cloud_aggregator.fleet.layout import (
    AGGREGATOR,
    AUTH_MODES,
    BIND_ALL,
    BROKER_USER,
    DEFAULT_HOSTS,
    HOME_ASSISTANT,
    OPERATOR,
    FleetInitError,
    FleetLayout,
    add_listener_args,
    print_device_lines,
    split_ids,
)
from cloud_aggregator.fleet.units import AGGREGATOR_USER, DEFAULT_VENV
from cloud_aggregator.operator import DefaultsHelpFormatter


def add_parser(fleet_sub: argparse._SubParsersAction) -> None:
    """``fleet init``, ``fleet add-device``, ``fleet renew-device``, ``fleet revoke-device`` and
    ``fleet end-sessions``; and the plants' and workers' commands."""
    _add_init_parser(fleet_sub)
    _add_device_parsers(fleet_sub)
    _add_end_sessions_parser(fleet_sub)
    fleet_plants.add_parser(fleet_sub)
    fleet_workers.add_parser(fleet_sub)


def _add_init_parser(fleet_sub: argparse._SubParsersAction) -> None:
    fmt = DefaultsHelpFormatter
    p = fleet_sub.add_parser(
        "init",
        help="generate a fleet's CA, broker and client certificates (or passwords), mosquitto config and ACL",
        formatter_class=fmt,
    )
    p.add_argument("--fleet", required=True, help="fleet id")
    p.add_argument("--devices", required=True, action="append", help="device ids, comma-separated")
    p.add_argument("--out", required=True, type=Path, help="folder to create (must not exist or be empty)")
    p.add_argument("--auth", choices=AUTH_MODES, default="certs", help="client certificates or passwords")
    add_listener_args(p, "the broker's", "the client configs")
    p.add_argument(
        "--operator-port",
        type=int,
        help="the operator's own TLS listener (console, fleet status, push; none given: --port + 1)",
    )
    p.add_argument("--days", type=int, default=825, help="validity of broker and client certificates")
    p.add_argument("--force", action="store_true", help="replace an existing fleet folder")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="K",
        help="give aggregator workers w1..wK ([collect] workers = K) their own login (later: fleet add-worker)",
    )
    p.add_argument(
        "--venv",
        type=Path,
        default=DEFAULT_VENV,
        help="the Python environment the systemd units run ioft from",
    )
    p.set_defaults(func=main)


def _add_device_parsers(fleet_sub: argparse._SubParsersAction) -> None:
    """``add-device``, ``renew-device`` and ``revoke-device``: one fleet folder, some devices."""
    fmt = DefaultsHelpFormatter
    for command, what, func in (
        (
            "add-device",
            "enrol devices: a certificate (or password) and a folder each, and the ACL",
            fleet_devices.main_add,
        ),
        ("renew-device", "a new certificate and key (or password) for devices", fleet_devices.main_renew),
        (
            "revoke-device",
            "revoke devices: the CRL (or password file) and ACL refuse them",
            fleet_devices.main_revoke,
        ),
    ):
        q = fleet_sub.add_parser(command, help=what, formatter_class=fmt)
        q.add_argument("--dir", required=True, type=Path, help="the fleet folder (`fleet init --out`)")
        q.add_argument("--devices", required=True, action="append", help="device ids, comma-separated")
        if command != "revoke-device":
            q.add_argument("--days", type=int, default=825, help="validity of the new certificates")
        if command == "renew-device":
            q.add_argument(
                "--revoke-old",
                action="store_true",
                help="revoke every earlier certificate of the devices now (a leaked key); by default the "
                "last one stays valid until it expires, so a device connects until its new files reach it",
            )
        q.set_defaults(func=func)


def _add_end_sessions_parser(fleet_sub: argparse._SubParsersAction) -> None:
    fmt = DefaultsHelpFormatter
    q = fleet_sub.add_parser(
        "end-sessions",
        help="after revoke-device and the broker's reload: end the revoked devices' live sessions",
        formatter_class=fmt,
    )
    q.add_argument("--dir", required=True, type=Path, help="the fleet folder (`fleet init --out`)")
    q.add_argument("--devices", required=True, action="append", help="revoked device ids, comma-separated")
    q.add_argument(
        "--broker", help="the broker they connect to (default: the fleet's; a plant's for its devices)"
    )
    q.add_argument(
        "--wait", type=float, default=10.0, help="seconds to wait for the broker to load the new CRL"
    )
    q.set_defaults(func=fleet_devices.main_end_sessions)


def _broker_lines(layout: FleetLayout) -> None:
    owner = broker_owner()
    if owner is None:
        print(
            f"  mosquitto started as root drops to user {BROKER_USER}: as root, "
            f"chown {BROKER_USER} {layout.root / 'broker' / 'server.key'} "
            + (f"{layout.passwd} " if layout.auth == "passwords" else "")
            + f"{layout.root / 'broker' / 'data'}"
        )
    elif (folder := unreachable_folder(layout.mosquitto_conf)) is not None:
        print(
            f"  mosquitto (user {BROKER_USER}) cannot enter {folder}: chmod o+x it, or keep the fleet elsewhere"
        )


def print_unit_lines(layout: FleetLayout) -> None:
    units = layout.root / "systemd"
    print(
        f"  services:   cp -r {units}/* /etc/systemd/system/ (serve as user {AGGREGATOR_USER}, "
        "mosquitto on this conf); as a service on a device: sudo sh <copied folder>/install.sh "
        "(README: Installing a Pi)"
    )
    agg = layout.root / AGGREGATOR
    if agg.stat().st_gid == 0 or agg.stat().st_mode & 0o070 == 0:
        print(
            f"  {AGGREGATOR_USER} must read {agg}: as root, useradd --system --user-group {AGGREGATOR_USER}; "
            f"chgrp -R {AGGREGATOR_USER} {agg}; chmod -R g+rX {agg}"
        )


def main(args: argparse.Namespace) -> int:
    """``fleet init``: write the fleet folder and print what to do with each part."""
    try:
        layout = init_fleet(
            args.out,
            args.fleet,
            split_ids(args.devices),
            auth=args.auth,
            hosts=split_ids(args.host) or DEFAULT_HOSTS,
            port=args.port,
            bind=args.bind,
            force=args.force,
            days=args.days,
            venv=args.venv,
            workers=args.workers,
            operator_port=args.operator_port,
        )
    except FleetInitError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"fleet {layout.fleet} ({layout.auth}) in {layout.root}")
    print(f"  broker:     mosquitto -c {layout.mosquitto_conf}   ({layout.broker_url})")
    _broker_lines(layout)
    print(f"  aggregator: cloud-aggregator serve --config {layout.toml(AGGREGATOR)}  (add [[task]] tables)")
    fleet_workers.print_worker_lines(layout, layout.workers)
    if args.bind in (None, "", BIND_ALL):
        print("  listens on every interface")
    else:
        print(
            f"  listens on {args.bind} only: devices on other machines need --bind {BIND_ALL} (or an address)"
        )
    print(
        f"  Home Assistant: {layout.identity_dir(HOME_ASSISTANT) / 'home-assistant.txt'} (its MQTT settings)"
    )
    print(
        f"  operator:   {layout.toml(OPERATOR)}  (console, fleet status, push, rollout --config; "
        f"its own listener, {layout.operator_url})"
    )
    print_device_lines(layout, layout.devices)
    print_unit_lines(layout)
    print(f"  keep {layout.root / 'ca' / 'ca.key'} offline: it signs new devices")
    print(f"  models: export --key {layout.signing_key}; devices trust {layout.model_public_key}")
    return 0

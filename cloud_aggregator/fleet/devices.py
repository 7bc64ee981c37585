"""``cloud-aggregator fleet add-device``, ``renew-device`` and ``revoke-device``: change an enrolled fleet.

Each works on the folder ``fleet init`` wrote (``--dir``), needs the CA key in it
(``ca/ca.key``) for certificates, and rewrites what the broker reads (the ACL, the
CRL or the password file) atomically, keeping the files' owner; the broker applies
them when reloaded (``systemctl reload mosquitto``, or SIGHUP).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from cloud_aggregator.fleet.acl import acl_text
from cloud_aggregator.fleet.broker_conf import mosquitto_password_hash
from cloud_aggregator.fleet.ca import FleetCA, cert_serial
from cloud_aggregator.fleet.files import fsync_tree, replace_file, swap_folder
from cloud_aggregator.fleet.identity import write_identity
from cloud_aggregator.fleet.layout import (
    FleetInitError,
    FleetLayout,
    device_errors,
    issued_devices,
    open_fleet,
    print_device_lines,
    read_plants,
    split_ids,
)
from cloud_aggregator.fleet.plant_files import refresh_plant
from cloud_aggregator.fleet.sessions import end_sessions, new_canary
from cloud_aggregator.fleet.units import venv_of, write_device_units
from cloud_aggregator.operator import revoked_serials

#: How long a CRL the fleet writes stays valid (mosquitto refuses every client once it expires).
CRL_DAYS = 3650
RELOAD_HINT = "reload the broker: systemctl reload mosquitto (or kill -HUP <mosquitto's pid>)"


def load_ca(layout: FleetLayout) -> FleetCA:
    key = layout.root / "ca" / "ca.key"
    if not key.exists():
        raise FleetInitError(f"{key} is missing: run this where the fleet's CA key is kept")
    return FleetCA.load(layout.ca_cert, key)


def _stage_device(layout: FleetLayout, ca: FleetCA | None, name: str, *, days: int) -> None:
    """Write ``devices/<name>/`` in a temp sibling, then swap it in (a crash leaves the old one)."""
    final = layout.identity_dir(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)
        write_identity(ca, layout, name, days=days, folder=tmp)
        write_device_units(tmp, layout.fleet, name, venv_of(layout))
        fsync_tree(tmp)
        swap_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def rewrite_acl(layout: FleetLayout, devices: Sequence[str]) -> None:
    """The cloud ACL (with each plant's bridge grants and the aggregator's workers) and every plant's ACL
    and CRL copy."""
    plants = [
        replace(p, devices=tuple(d for d in p.devices if d in devices)) for p in read_plants(layout.root)
    ]
    bridges = {p.bridge: p.devices for p in plants}
    workers = {p.bridge: p.worker for p in plants if p.worker}
    revoked = issued_devices(layout) - set(devices) - set(bridges)
    replace_file(layout.acl, acl_text(layout.fleet, devices, bridges, workers, layout.workers, revoked))
    for plant in plants:
        refresh_plant(layout, plant)


def _passwd_lines(layout: FleetLayout) -> dict[str, str]:
    lines = layout.passwd.read_text().splitlines()
    return {line.split(":", 1)[0]: line for line in lines if ":" in line}


def add_devices(root: str | Path, devices: Sequence[str], *, days: int = 825) -> FleetLayout:
    """Enrol ``devices`` in the fleet at ``root``: a certificate (or password) and folder each, and
    the ACL; reload the broker afterwards (SIGHUP) for the ACL and password file to apply.

    Raises
    ------
    FleetInitError
        On a bad or reserved id, one already enrolled, or a folder that is not a fleet.
    """
    layout = open_fleet(root)
    errors = device_errors(devices)
    errors += [f"{d} is already enrolled ({layout.identity_dir(d)})" for d in devices if d in layout.devices]
    if errors:
        raise FleetInitError("cannot add devices:\n  - " + "\n  - ".join(errors))
    passwords = {d: secrets.token_urlsafe(24) for d in devices} if layout.auth == "passwords" else {}
    new = replace(layout, devices=(*layout.devices, *devices), passwords=passwords)
    ca = load_ca(new) if new.auth == "certs" else None
    for d in devices:
        _stage_device(new, ca, d, days=days)
    if passwords:
        lines = _passwd_lines(new) | {d: f"{d}:{mosquitto_password_hash(p)}" for d, p in passwords.items()}
        replace_file(new.passwd, "".join(f"{line}\n" for line in lines.values()), private=True)
    rewrite_acl(new, new.devices)
    return new


def renew_devices(
    root: str | Path, devices: Sequence[str], *, days: int = 825, revoke_old: bool = False
) -> FleetLayout:
    """A new certificate and key (or password) for each of ``devices``, in its folder.

    The old certificate stays valid until it expires, so a device keeps connecting until
    its new files are copied to it; ``revoke_old`` puts every earlier certificate of the
    device in the CRL at once instead (a key that may have leaked).  A renewed password replaces the old one at the broker's reload.
    """
    layout = open_fleet(root)
    errors = [f"{d} is not enrolled (enrolled: {', '.join(layout.devices)})" for d in devices
              if d not in layout.devices]  # fmt: skip
    if not devices or errors:
        raise FleetInitError("cannot renew:\n  - " + "\n  - ".join(errors or device_errors(devices)))
    passwords = {d: secrets.token_urlsafe(24) for d in devices} if layout.auth == "passwords" else {}
    new = replace(layout, passwords=passwords)  # a plant's device keeps its plant's broker
    ca = load_ca(new) if new.auth == "certs" else None
    old = _issued_serials(new, devices) if ca is not None else set()
    for d in devices:
        _stage_device(new, ca, d, days=days)
    if revoke_old and ca is not None and old:
        before = revoked_serials(new.crl.read_bytes()) if new.crl.exists() else set()
        replace_file(new.crl, ca.crl(before | old, days=CRL_DAYS))
    if passwords:
        lines = _passwd_lines(new) | {d: f"{d}:{mosquitto_password_hash(p)}" for d, p in passwords.items()}
        replace_file(new.passwd, "".join(f"{line}\n" for line in lines.values()), private=True)
    return new


def _issued_serials(layout: FleetLayout, devices: Sequence[str]) -> set[int]:
    """The serial of every certificate the fleet's CA issued to ``devices`` so far."""
    text = layout.issued.read_text() if layout.issued.exists() else ""  # older fleets have no record
    issued = [line.split("\t") for line in text.splitlines() if line.count("\t") == 2]
    serials = {int(serial, 16) for serial, name, _ in issued if name in devices}
    return serials | {cert_serial(layout.cert(d).read_bytes()) for d in devices if layout.cert(d).exists()}


def revoke_devices(root: str | Path, devices: Sequence[str], *, crl_days: int = CRL_DAYS) -> FleetLayout:
    """Revoke ``devices``: every certificate the CA issued them goes into the CRL (or their
    password line goes), they leave the ACL, and their folder is deleted.  Reload the
    broker afterwards (SIGHUP or restart): a password device's session ends then; a certificate
    device's lives on until ``fleet end-sessions`` (:mod:`cloud_aggregator.fleet.sessions`)
    takes it over, and it is refused from its next connection on.
    """
    layout = open_fleet(root)
    errors = [f"{d} is not enrolled (enrolled: {', '.join(layout.devices)})" for d in devices
              if d not in layout.devices]  # fmt: skip
    if not devices or errors:
        raise FleetInitError("cannot revoke:\n  - " + "\n  - ".join(errors or device_errors(devices)))
    if layout.auth == "certs":
        ca = load_ca(layout)
        serials = _issued_serials(layout, devices)
        before = revoked_serials(layout.crl.read_bytes()) if layout.crl.exists() else set()
        # A fresh canary in the CRL too: `end-sessions` sees from it that the broker reloaded.
        replace_file(layout.crl, ca.crl(before | serials | {new_canary(layout, ca)}, days=crl_days))
    else:
        lines = {u: line for u, line in _passwd_lines(layout).items() if u not in devices}
        replace_file(layout.passwd, "".join(f"{line}\n" for line in lines.values()), private=True)
    remaining = tuple(d for d in layout.devices if d not in devices)
    rewrite_acl(layout, remaining)
    for d in devices:
        shutil.rmtree(layout.identity_dir(d))
    plants = {d: url for d, url in layout.plant_brokers.items() if d in remaining}
    return replace(layout, devices=remaining, passwords={}, plant_brokers=plants)  # the workers stay


def _run(
    args: argparse.Namespace, change: Callable[[list[str]], FleetLayout]
) -> tuple[FleetLayout, list[str]] | None:
    """``change`` applied to ``--devices``; a failure is one line on stderr and ``None``."""
    devices = split_ids(args.devices)
    try:
        return change(devices), devices
    except (FleetInitError, OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return None


def main_add(args: argparse.Namespace) -> int:
    """``fleet add-device``."""
    done = _run(args, lambda devices: add_devices(args.dir, devices, days=args.days))
    if done is None:
        return 2
    layout, devices = done
    print(f"fleet {layout.fleet}: enrolled {', '.join(devices)}; {RELOAD_HINT}")
    print_device_lines(layout, devices)
    return 0


def main_renew(args: argparse.Namespace) -> int:
    """``fleet renew-device``."""
    revoke_old = getattr(args, "revoke_old", False)
    done = _run(args, lambda devices: renew_devices(args.dir, devices, days=args.days, revoke_old=revoke_old))
    if done is None:
        return 2
    layout, devices = done
    if layout.auth != "certs":
        kept = RELOAD_HINT
    elif revoke_old:
        kept = f"the old certificate is revoked; {RELOAD_HINT}"
    else:
        kept = "the old certificate stays valid until it expires; --revoke-old ends it now"
    print(f"fleet {layout.fleet}: renewed {', '.join(devices)} ({kept})")
    print_device_lines(layout, devices)
    return 0


def main_revoke(args: argparse.Namespace) -> int:
    """``fleet revoke-device``."""
    done = _run(args, lambda devices: revoke_devices(args.dir, devices))
    if done is None:
        return 2
    layout, devices = done
    print(f"fleet {layout.fleet}: revoked {', '.join(devices)}; {RELOAD_HINT}")
    if layout.auth == "certs":
        ids = ",".join(devices)
        print(f"  then end a live session (a reload keeps it): cloud-aggregator fleet end-sessions "
              f"--dir {layout.root} --devices {ids}")  # fmt: skip
    if layout.auth == "certs" and "crlfile" not in layout.mosquitto_conf.read_text():
        print(f"  {layout.mosquitto_conf} has no crlfile line (an older fleet): add `crlfile {layout.crl}`")
    return 0


def main_end_sessions(args: argparse.Namespace) -> int:
    """``fleet end-sessions``: after revoke-device and the broker's reload."""
    done = _run(args, lambda devices: _ended(args, devices))
    if done is None:
        return 2
    layout, devices = done
    if layout.auth != "certs":
        print(
            f"fleet {layout.fleet}: a password fleet: the broker's reload ended {', '.join(devices)}'s sessions"
        )
    else:
        print(
            f"fleet {layout.fleet}: ended the live sessions of {', '.join(devices)} (their status says revoked)"
        )
    return 0


def _ended(args: argparse.Namespace, devices: list[str]) -> FleetLayout:
    end_sessions(args.dir, devices, crl_days=CRL_DAYS, broker=args.broker, wait_s=args.wait)
    return open_fleet(args.dir)

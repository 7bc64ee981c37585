"""Writing a fleet folder's files safely: fsynced, atomically replaced, swapped in whole, and handed to
the user mosquitto runs as."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import stat
from pathlib import Path

from cloud_aggregator.fleet.layout import BROKER_USER, FleetLayout


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

"""``cloud-aggregator store backups|restore``: list the store's online backups, put one in place.

Run ``restore`` with ``serve`` stopped; ``serve`` then resumes from the backup's rounds
(``cloud_aggregator.store.backup``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cloud_aggregator.store.backup import BACKUPS, StoreDamagedError, backup_rounds, list_backups, restore
from ioft_protocol.config import ConfigError, load_toml


def _store_path(args: argparse.Namespace) -> Path | None:
    """``<state_dir>/aggregator.sqlite`` from ``--state-dir`` or ``--config``; ``None`` after one line on stderr."""
    state_dir = args.state_dir
    if state_dir is None and args.config is not None:
        try:
            state_dir = load_toml(args.config).get("state_dir")
        except ConfigError as exc:
            print("; ".join(exc.errors), file=sys.stderr)
            return None
    if not state_dir:
        print(
            "store needs --config (the aggregator's TOML, for its state_dir) or --state-dir", file=sys.stderr
        )
        return None
    return Path(state_dir) / "aggregator.sqlite"


def _rounds(path: Path) -> str:
    rounds = backup_rounds(path)
    return ", ".join(f"{t} resumes at round {r}" for t, r in rounds.items()) or "no round saved"


def main_backups(args: argparse.Namespace) -> int:
    store = _store_path(args)
    if store is None:
        return 2
    found = list_backups(store.parent / BACKUPS)
    if not found:
        print(f"no backup in {store.parent / BACKUPS}")
    for path in found:
        print(f"{path}  ({_rounds(path)})")
    return 0


def main_restore(args: argparse.Namespace) -> int:
    store = _store_path(args)
    if store is None:
        return 2
    try:
        used, kept = restore(store, args.backup)
    except (StoreDamagedError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 2
    aside = f"; the replaced store is kept as {kept}" if kept else ""
    print(f"restored {store} from {used} ({_rounds(store)}){aside}; start serve again")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="the aggregator store's backups: list them, restore one")
    store_sub = p.add_subparsers(dest="store_command", required=True)
    for name, func, text in (
        ("backups", main_backups, "list the online backups serve took ([store] backup_every)"),
        (
            "restore",
            main_restore,
            "put the newest (or the given) backup in place of aggregator.sqlite; stop serve first",
        ),
    ):
        s = store_sub.add_parser(name, help=text)
        s.add_argument("--config", type=Path, help="the aggregator's TOML (its state_dir)")
        s.add_argument("--state-dir", help="the aggregator's state folder (default: --config's state_dir)")
        if name == "restore":
            s.add_argument("backup", nargs="?", type=Path, help="a backup file (default: the newest)")
        s.set_defaults(func=func)

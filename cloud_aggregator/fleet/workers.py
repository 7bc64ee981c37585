"""``cloud-aggregator fleet add-worker``: an aggregator worker's own login on the fleet's broker.

``serve`` with ``[collect] workers = K`` runs K ``cloud-aggregator worker`` processes
(``cloud_aggregator.serve.workers``).  The fleet's broker makes each login's identity (certificate CN
or password-file user) its username and its client id (``use_username_as_clientid``), so K
workers logging in with the aggregator's certificate would take over each other's connection
and serve's.  Each worker gets its own identity instead, ``worker.<id>``, written by ``fleet init
--workers K`` (``w1``..``wK``) or ``fleet add-worker --id w3`` into ``aggregator/workers/``::

    <id>.toml                  its login: [tls] cert_file/key_file (certs) or username/password
    worker.<id>.crt, .key      (--auth certs) its certificate, CN worker.<id>, from the fleet CA
                               (recorded in ca/issued.tsv)

and a stanza in the broker's ACL (:func:`cloud_aggregator.fleet.acl.worker_acl_text`, the same
one a plant's partial aggregator gets on its plant's broker).  ``cloud-aggregator worker --config
aggregator.toml --id <id>`` logs in with ``workers/<id>.toml`` beside the config
(:mod:`cloud_aggregator.worker_login`); ``serve`` refuses to start workers it has no login for.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from cloud_aggregator.fleet.broker_conf import mosquitto_password_hash
from cloud_aggregator.fleet.devices import RELOAD_HINT, _passwd_lines, load_ca, rewrite_acl
from cloud_aggregator.fleet.files import fsync_tree, replace_file
from cloud_aggregator.fleet.identity import write_worker_identity
from cloud_aggregator.fleet.layout import (
    AGGREGATOR,
    FleetInitError,
    FleetLayout,
    open_fleet,
    split_ids,
    worker_errors,
    worker_identity,
)
from cloud_aggregator.fleet.units import give_to_aggregator
from cloud_aggregator.operator import DefaultsHelpFormatter


def add_workers(root: str | Path, workers: Sequence[str], *, days: int = 825) -> FleetLayout:
    """Give aggregator workers ``workers`` their own login in the fleet at ``root`` and grant them the
    ACL's worker stanza; reload the broker afterwards (SIGHUP) for the ACL and password file to apply.

    Raises
    ------
    FleetInitError
        On a bad or repeated id, a worker that exists, a plant worker's id, or a folder that is not a fleet.
    """
    layout = open_fleet(root)
    workers = tuple(workers)
    errors = worker_errors(layout, workers)
    if errors:
        raise FleetInitError("cannot add workers:\n  - " + "\n  - ".join(errors))
    names = {worker_identity(w): w for w in workers}
    passwords = {n: secrets.token_urlsafe(24) for n in names} if layout.auth == "passwords" else {}
    new = replace(layout, workers=tuple(sorted((*layout.workers, *workers))), passwords=passwords)
    ca = load_ca(new) if new.auth == "certs" else None
    # Written beside workers/ and moved in file by file, each login last: open_fleet counts a worker by
    # its login, so a crash leaves at most a certificate no login names (and issued.tsv lists it).
    new.workers_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".workers.tmp-", dir=new.workers_dir.parent))
    try:
        for w in workers:
            write_worker_identity(ca, new, w, days=days, folder=tmp)
        fsync_tree(tmp)
        for path in sorted(tmp.iterdir(), key=lambda p: p.suffix == ".toml"):
            os.replace(path, new.workers_dir / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    give_to_aggregator(new.root)
    if passwords:
        lines = _passwd_lines(new) | {n: f"{n}:{mosquitto_password_hash(p)}" for n, p in passwords.items()}
        replace_file(new.passwd, "".join(f"{line}\n" for line in lines.values()), private=True)
    rewrite_acl(new, new.devices)
    return new


def print_worker_lines(layout: FleetLayout, workers: Sequence[str]) -> None:
    """What the operator does with the workers' logins."""
    if not workers:
        return
    print(
        f"  workers:    {', '.join(workers)} log in as {', '.join(worker_identity(w) for w in workers)} "
        f"({layout.workers_dir}/); set [collect] workers = {len(layout.workers)} in "
        f"{layout.toml(AGGREGATOR)} and serve starts them"
    )
    print(
        f"              on another machine (spawn_workers = false): copy {layout.toml(AGGREGATOR)}, "
        f"{layout.ca_cert} and {layout.workers_dir}/<id>.* there (same paths), then "
        f"cloud-aggregator worker --config {layout.toml(AGGREGATOR)} --id <id>"
    )


def add_parser(fleet_sub: argparse._SubParsersAction) -> None:
    """``fleet add-worker``."""
    p = fleet_sub.add_parser(
        "add-worker",
        help="an aggregator worker's own login ([collect] workers): certificate (or password) and ACL",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--dir", required=True, type=Path, help="the fleet folder (`fleet init --out`)")
    p.add_argument("--id", required=True, action="append", help="worker ids (w3; comma-separated)")
    p.add_argument("--days", type=int, default=825, help="validity of the workers' certificates")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """``fleet add-worker``: write the workers' logins and say what to do with them."""
    workers = split_ids(args.id)
    try:
        layout = add_workers(args.dir, workers, days=args.days)
    except (FleetInitError, OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"fleet {layout.fleet}: aggregator workers {', '.join(workers)} added; {RELOAD_HINT}")
    print_worker_lines(layout, workers)
    return 0

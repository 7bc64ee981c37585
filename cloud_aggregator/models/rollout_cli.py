"""``push --canary`` and ``cloud-aggregator rollout status | abort | resume``.

The rollout's state lives in the aggregator's store (``<state_dir>/aggregator.sqlite``,
``state_dir`` from ``--config`` or ``--state-dir``), so ``status`` needs no broker and
``resume`` takes up a rollout whose command was interrupted.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloud_aggregator.models import push, rollout_run
from cloud_aggregator.models.push_answers import INSTALLED, wait_for_answers
from cloud_aggregator.models.rollout import MARGIN, MIN_INSTALLED, Rollout, RolloutError, State, describe
from cloud_aggregator.operator import (
    DefaultsHelpFormatter,
    add_session_args,
    operator_config,
    operator_session,
)
from cloud_aggregator.store.sqlite import SqliteStore
from export.keys import load_private_key
from export.package import Package
from ioft_protocol.config import ConfigError
from ioft_protocol.manifest import ManifestError
from ioft_protocol.mqtt import MqttSession

STORE = "aggregator.sqlite"


def add_canary_args(p: argparse.ArgumentParser) -> None:
    """``push``'s staged-rollout options."""
    p.add_argument(
        "--canary",
        metavar="N|P%",
        help="staged rollout: offer the version to N devices (or P%% of them, first by id) first, and "
        "to the rest only when they pass the checks below (see `rollout`)",
    )
    p.add_argument(
        "--min-installed",
        type=_share,
        default=MIN_INSTALLED,
        help="share of the canaries that must install it without a rollback",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=MARGIN,
        help="how far below the replaced version's holdout score a canary's may be",
    )
    p.add_argument(
        "--signing-key",
        type=Path,
        help="with --canary: the fleet's private key (keygen), which signs the withdrawal a stopped "
        "rollout publishes (devices refuse an unsigned one)",
    )
    p.add_argument("--state-dir", type=Path, help="the aggregator's state folder (default: --config's)")
    p.set_defaults(func=push_main)


def push_main(args: argparse.Namespace) -> int:
    """``push``, staged when ``--canary`` is given (the store checked before anything connects)."""
    if args.canary:
        try:
            open_store(args, readonly=True).close()
        except (RolloutError, ConfigError) as exc:
            print(f"cannot push: {exc}", file=sys.stderr)
            return 2
    return push.main(args, canary=canary_push if args.canary else None)


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def open_store(args: argparse.Namespace, *, readonly: bool = False) -> SqliteStore:
    """The aggregator's store, where ``--state-dir`` or the ``--config`` TOML says; never created here
    (a rollout recorded anywhere but where serve and the console read it is lost to them).

    Raises
    ------
    ConfigError
        ``--config`` is not a valid TOML.
    RolloutError
        No store there, or a file that is not one: the message names the file.
    """
    path = Path(operator_config(args, connects=False).state_dir) / STORE
    if not path.is_file():
        raise RolloutError(
            f"no aggregator store at {path}: give the folder serve keeps its state in "
            "(state_dir in --config, which fleet init's operator.toml names, or --state-dir)"
        )
    try:
        store = SqliteStore(path, readonly=readonly)
        store.rollouts(None)  # a file that is not a store fails here, before anything is published
    except sqlite3.DatabaseError as exc:
        raise RolloutError(
            f"{path} is not an aggregator store ({exc}); check state_dir / --state-dir"
        ) from None
    return store


def canary_push(
    args: argparse.Namespace, session: MqttSession, fleet: str, package: Package, targets: tuple[str, ...]
) -> int:
    """``push --canary``: start the rollout, follow the canaries, promote or stop; 0 when promoted."""
    signing_key = _canary_key(args)
    if signing_key is None:
        return 2
    try:
        store = open_store(args)
        r, report = rollout_run.start(
            session,
            store,
            fleet,
            package,
            canary=args.canary,
            targets=targets,
            min_installed=args.min_installed,
            margin=args.margin,
            chunk_size=args.chunk_size,
            signing_key=signing_key,
        )
    except (RolloutError, ConfigError) as exc:
        print(f"cannot push: {exc}", file=sys.stderr)
        return 2
    print(
        f"pushed {r.model} v{r.version} to canaries {', '.join(r.canaries)} of fleet {fleet}: "
        f"{report.size} bytes in {report.chunks} chunks ({report.seconds:.3f} s); waiting for their answers",
        flush=True,
    )
    r = rollout_run.follow(session, store, fleet, r, timeout=args.wait_timeout)
    print(describe(r))
    return _after_follow(args, session, fleet, r, targets)


def _canary_key(args: argparse.Namespace) -> Ed25519PrivateKey | None:
    """The fleet's private key ``push --canary`` signs a withdrawal with; ``None`` (said why) when the
    arguments do not give one, or ``--margin`` is negative."""
    if args.margin < 0:
        print("cannot push: --margin must be >= 0", file=sys.stderr)
        return None
    if args.signing_key is None:
        print(
            "cannot push: --canary needs --signing-key (the fleet's private key): a stopped rollout takes "
            "the version back with a withdrawal the fleet key signs",
            file=sys.stderr,
        )
        return None
    try:
        return load_private_key(args.signing_key)
    except ManifestError as exc:
        print(f"cannot push: {exc}", file=sys.stderr)
        return None


def _after_follow(
    args: argparse.Namespace, session: MqttSession, fleet: str, r: Rollout, targets: tuple[str, ...]
) -> int:
    """Once the canaries are followed: 1 unless promoted (saying how to go on if undecided); with
    ``--wait``, every target's answer (0 when all installed it)."""
    if r.state != State.PROMOTED:
        if r.state == State.CANARY:
            print(
                f"undecided: `rollout resume {r.model}` follows it again, `rollout abort {r.model}` stops it"
            )
        return 1
    if not args.wait:
        return 0
    answers = wait_for_answers(session, fleet, r.model, r.version, targets, timeout=args.wait_timeout)
    for a in answers:
        print(f"  {a.device}: {a.state}" + (f" ({a.detail})" if a.detail else ""))
    return 0 if all(a.state == INSTALLED for a in answers) else 1


# -- rollout status | abort | resume ------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout", help="staged model rollouts (push --canary): status, abort, resume")
    rsub = p.add_subparsers(dest="rollout_command", required=True)
    s = rsub.add_parser(
        "status", help="each model's latest rollout, from the store", formatter_class=DefaultsHelpFormatter
    )
    s.add_argument("model", nargs="?", help="only this model")
    s.add_argument("--all", action="store_true", help="every rollout, not only each model's latest")
    s.add_argument("--json", action="store_true", help="the stored records as JSON (offers left out)")
    _store_args(s)
    s.set_defaults(func=status_main)
    for name, helptext, func in (
        ("abort", "stop a rollout in its canary phase: the canaries roll back", abort_main),
        ("resume", "follow an undecided rollout's canaries again, then promote or stop it", resume_main),
    ):
        c = rsub.add_parser(name, help=helptext, formatter_class=DefaultsHelpFormatter)
        c.add_argument("model", help="the model whose latest rollout this is")
        add_session_args(c)
        c.add_argument("--state-dir", type=Path, help="the aggregator's state folder (default: --config's)")
        c.add_argument("--wait-timeout", type=float, default=120.0, help="seconds to wait for the canaries")
        c.set_defaults(func=func)


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="the operator's (or the aggregator's) TOML: its state_dir")
    p.add_argument("--state-dir", type=Path, help="the aggregator's state folder (default: --config's)")
    p.set_defaults(broker=None, fleet=None, allow_plaintext=False)


def status_main(args: argparse.Namespace) -> int:
    try:
        store = open_store(args, readonly=True)
    except ConfigError as exc:
        print(
            f"cannot read rollouts: {args.config or 'command line'}: {'; '.join(exc.errors)}", file=sys.stderr
        )
        return 2
    except RolloutError as exc:
        print(f"cannot read rollouts: {exc}", file=sys.stderr)
        return 2
    if args.all:
        found = [Rollout.from_json(t) for t in store.rollouts(args.model)]
        found.sort(key=lambda r: r.started_at)
    else:
        found = rollout_run.latest(store, args.model)
    if args.json:
        out = [{k: v for k, v in json.loads(r.to_json()).items() if not k.endswith("_offer")} for r in found]
        print(json.dumps(out, indent=2))
        return 0
    if not found:
        print("no rollouts" + (f" of {args.model}" if args.model else ""))
    for r in found:
        print(describe(r))
    return 0


def _current(args: argparse.Namespace) -> tuple[SqliteStore, Rollout]:
    store = open_store(args)
    found = rollout_run.latest(store, args.model)
    if not found:
        raise RolloutError(f"no rollout of {args.model} in {store.path}")
    r = found[-1]
    if r.state != State.CANARY:
        raise RolloutError(
            f"the rollout of {r.model} v{r.version} is {r.state} ({r.reason}); only one in its canary "
            "phase can be aborted or resumed (push a new version instead)"
        )
    return store, r


def abort_main(args: argparse.Namespace) -> int:
    return _act(args, abort=True)


def resume_main(args: argparse.Namespace) -> int:
    return _act(args, abort=False)


def _act(args: argparse.Namespace, *, abort: bool) -> int:
    try:
        store, r = _current(args)
        session, fleet = operator_session(args, "rollout")
    except ConfigError as exc:
        print(
            f"cannot {'abort' if abort else 'resume'}: {args.config or 'command line'}: {'; '.join(exc.errors)}",
            file=sys.stderr,
        )
        return 2
    except (RolloutError, ValueError) as exc:
        print(f"cannot {'abort' if abort else 'resume'}: {exc}", file=sys.stderr)
        return 2
    try:
        if abort:
            r = rollout_run.stop(
                session,
                store,
                fleet,
                r,
                "aborted by the operator",
                state=State.ABORTED,
                timeout=args.wait_timeout,
            )
        else:
            r = rollout_run.follow(session, store, fleet, r, timeout=args.wait_timeout)
    finally:
        session.stop()
    print(describe(r))
    return 0 if r.state in (State.PROMOTED, State.ABORTED) else 1

"""``cloud-aggregator``: the cloud side's command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sqlite3
import sys
from pathlib import Path

from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.console import cli as console
from cloud_aggregator.console import fleet_status
from cloud_aggregator.console import privacy as fleet_privacy
from cloud_aggregator.fleet import commands as fleet_commands
from cloud_aggregator.fleet.init import FleetInitError
from cloud_aggregator.local.demo import run_demo
from cloud_aggregator.models import push, rollout_cli
from cloud_aggregator.models.backbones import cli as backbones_cli
from cloud_aggregator.serve import workers
from cloud_aggregator.serve.reload import Control, ServeRefusedError, Terminated
from cloud_aggregator.serve.server import serve
from cloud_aggregator.store import cli as store_cli
from cloud_aggregator.store.backup import StoreDamagedError, restore_hint
from export import cli as export_cli
from export.package import ExportError
from ioft_protocol.cli import check_broker_login, entry_point, flags_over_toml
from ioft_protocol.config import ConfigError, build, load_toml


def _serve_config(args: argparse.Namespace) -> AggregatorConfig:
    """The config file with the command line's overrides, validated (``ConfigError`` if not)."""
    raw = load_toml(args.config) if args.config else {}
    flags_over_toml(raw, args, "broker", "state_dir", "allow_plaintext", "restart", "resume_from_devices")
    return build(AggregatorConfig, raw, str(args.config or "command line"))


def _serve(args: argparse.Namespace) -> int:
    cfg = _checked_serve_config(args)
    if cfg is None:
        return 2
    if not cfg.task and not args.service:
        print("no [[task]] configured; nothing to do (add one, or run with --service)", file=sys.stderr)
        return 2
    control = Control()
    before = _handle_signals(args, control)
    try:
        return _run_serve(cfg, control, args)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _checked_serve_config(args: argparse.Namespace) -> AggregatorConfig | None:
    """``serve``'s config, its broker login checked; ``None`` (said why, in one line) if invalid."""
    try:
        cfg = _serve_config(args)
        check_broker_login(cfg, cfg.client_id, str(args.config or "command line"))
    except ConfigError as exc:  # one line: every failing field, what to fix
        print(
            f"invalid configuration in {args.config or 'command line'}: {'; '.join(exc.errors)}",
            file=sys.stderr,
        )
        return None
    return cfg


def _handle_signals(args: argparse.Namespace, control: Control) -> dict[int, object]:
    """SIGTERM ends ``serve`` (saved rounds kept); with ``--service`` and a config, SIGHUP re-reads it.
    Returns the handlers they replace, for the caller to restore."""
    # Restored on return: a caller in the same process (a test) keeps its own handlers, and a
    # process it forks later (a study's worker pool) does not inherit ours.
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    if args.service and args.config:

        def _reload() -> AggregatorConfig:
            # A restart (or a jump past the devices) is for start-up only.
            raw_args = argparse.Namespace(**{**vars(args), "restart": None, "resume_from_devices": False})
            return _serve_config(raw_args)

        control.reload = _reload
        signal.signal(signal.SIGHUP, lambda *_: control.reload_requested.set())

    def _term(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let the first unwind
        raise Terminated

    signal.signal(signal.SIGTERM, _term)
    return before


def _run_serve(cfg: AggregatorConfig, control: Control, args: argparse.Namespace) -> int:
    """``serve`` until its tasks are done (or stopped); its exit code, a failure in one line."""
    log = logging.getLogger(__name__)
    try:
        serve(cfg, control, service=args.service, worker_argv=_worker_argv(args))
    except ServeRefusedError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (StoreDamagedError, sqlite3.DatabaseError) as exc:  # found while running: one line, no traceback
        db = Path(cfg.state_dir) / "aggregator.sqlite"
        print(
            exc if isinstance(exc, StoreDamagedError) else f"{db}: {exc}; {restore_hint(db)}", file=sys.stderr
        )
        return 1
    except Terminated:
        log.info("stopped by SIGTERM; every finished round is saved, `serve` again resumes")
        return 0
    except KeyboardInterrupt:
        log.info("interrupted; every finished round is saved, `serve` again resumes")
        return 130
    return 0


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """``cloud-aggregator worker``'s arguments for the workers ``serve`` starts: its own config."""
    argv = ["--config", str(args.config)] if args.config else []
    argv += ["--broker", args.broker] if args.broker else []
    return argv + (["--allow-plaintext"] if args.allow_plaintext else [])


def _demo(args: argparse.Namespace) -> int:
    try:
        return run_demo(
            devices=args.devices,
            rounds=args.rounds,
            broker=args.broker,
            workdir=args.workdir,
            prefer=args.prefer_broker,
            console=args.console,
        )
    except KeyboardInterrupt:
        print("\ndemo stopped; the broker and the fleet's processes are stopped too", file=sys.stderr)
        return 130


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="orchestrate the configured tasks' rounds over MQTT")
    s.add_argument("--config", type=Path, help="TOML config with [[task]] tables")
    s.add_argument("--broker", help="mqtt://host:port or mqtts://host:port")
    s.add_argument("--state-dir", help="folder for aggregator.sqlite and artifacts")
    s.add_argument("--allow-plaintext", action="store_true")
    s.add_argument(
        "--restart",
        action="append",
        metavar="TASK",
        help="delete TASK's stored rounds (saying what) and start it afresh; repeatable",
    )
    s.add_argument(
        "--resume-from-devices",
        action="store_true",
        help="when the store is behind its devices (an older or a fresh aggregator.sqlite): go on past the "
        "round they trained last",
    )
    s.add_argument(
        "--service",
        action="store_true",
        help="keep running when the tasks are done; SIGHUP re-reads --config for new or extended tasks",
    )
    s.set_defaults(func=_serve)


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="a whole fleet on this machine: broker, aggregator, simulated printers")
    d.add_argument("--devices", type=int, default=4, help="number of simulated printers (>= 2)")
    d.add_argument("--rounds", type=int, default=200)
    d.add_argument("--broker", help="use this broker instead of starting one (mqtt://host:port)")
    d.add_argument("--workdir", type=Path, help="where state goes (default: a fresh temp folder)")
    d.add_argument("--prefer-broker", default="mosquitto", choices=["mosquitto", "amqtt"])
    d.add_argument(
        "--console", action="store_true", help="serve the live fleet console too, and leave it up afterwards"
    )
    d.set_defaults(func=_demo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cloud-aggregator", description="ioft cloud side: rounds, aggregation, models."
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)

    _add_serve_parser(sub)
    workers.add_parser(sub)  # [collect] workers: cloud_aggregator/serve/workers.py
    _add_demo_parser(sub)

    # Models: each subcommand lives in its own module; only the wiring is here.
    export_cli.add_parsers(sub)
    backbones_cli.add_parsers(sub)
    rollout_cli.add_canary_args(push.add_parser(sub))  # push --canary: a staged rollout
    rollout_cli.add_parser(sub)
    console.add_parser(sub)
    store_cli.add_parser(sub)  # store backups | restore: cloud_aggregator/store/backup.py
    fleet = sub.add_parser("fleet", help="fleet-wide views and set-up")
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True)
    fleet_status.add_parser(fleet_sub)
    fleet_privacy.add_parser(fleet_sub)
    fleet_commands.add_parser(fleet_sub)
    return p


#: Subcommands that run the aggregator itself: their lines say ``aggregator``.
AGGREGATOR_COMMANDS = frozenset({"serve", "demo", "worker"})


def log_name(args: argparse.Namespace) -> str:
    """Who a log line comes from: ``aggregator`` for the aggregator's own commands, else the
    command (``console``, ``push``, ``fleet-status``, ``export``...), so an operator's tools
    beside ``serve`` are told apart in a shared log."""
    if args.command in AGGREGATOR_COMMANDS:
        return "aggregator"
    sub = getattr(args, "fleet_command", None) if args.command == "fleet" else None
    return f"{args.command}-{sub}" if sub else args.command


@entry_point("cloud-aggregator", mistakes=(FleetInitError,), failures=(ExportError,))
def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a user mistake is one line and exit 2, a runtime failure one line and 1."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s {log_name(args)} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

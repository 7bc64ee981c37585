"""``cloud-aggregator worker`` and ``[collect] workers = K``: the processes of K aggregator workers
that share a fleet's uplink.  What one worker does is :mod:`cloud_aggregator.serve.worker_loop`;
the coordinator that merges their batches is :mod:`cloud_aggregator.serve.coordinator`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cloud_aggregator import worker_login
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.serve import worker_wire as wire
from cloud_aggregator.serve.worker_loop import AggregatorWorker
from ioft_protocol import codec
from ioft_protocol.config import ConfigError, build, load_toml
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import SessionOptions
from ioft_protocol.service import Notifier

log = logging.getLogger(__name__)

#: Seconds a supervised local worker that died waits before ``serve`` starts it again.
RESTART_S = 1.0


# -- processes ---------------------------------------------------------------------------------
def worker_options(cfg: AggregatorConfig, worker: str) -> SessionOptions:
    """A clean session: when a worker dies the broker stops giving it uploads (a persistent one
    would keep receiving its share while away; see the README, "Aggregators that scale out")."""
    topic = wire.topic_worker(cfg.fleet, worker)
    return SessionOptions.for_login(
        cfg,
        f"{cfg.client_id}-{worker}",
        clean_session=True,
        will=(topic, wire.OFFLINE),
        birth=lambda: [(topic, wire.ONLINE)],
        inbound_limit=max(100_000, 4 * len(cfg.collect.expected)),
    )


def run_worker(
    cfg: AggregatorConfig, worker: str, stop: threading.Event | None = None, *, plant: bool = False
) -> None:
    stop = stop or threading.Event()
    notifier = Notifier.from_env()  # a no-op outside a Type=notify unit
    session = MqttSession(worker_options(cfg, worker))
    w = AggregatorWorker(
        session, cfg.fleet, worker, cfg.admission.policy(), cfg.max_payload_bytes, plant=plant
    )
    session.start(timeout=None)
    log.info("worker %s of fleet %s: sharing the uplink (group %s)", worker, cfg.fleet, wire.GROUP)
    try:
        w.run(stop, notifier)
    finally:
        notifier.stopping()
        notifier.close()
        session.stop(final=(wire.topic_worker(cfg.fleet, worker), wire.OFFLINE))
        log.info("worker %s stopped: %d uploads admitted, %d batches", worker, w.admitted, w.batches)


class LocalWorkers:
    """``[collect] workers = K`` with ``spawn_workers``: ``serve`` runs K ``cloud-aggregator worker``
    processes beside itself, and starts one again ``RESTART_S`` after it dies."""

    def __init__(self, count: int, argv: list[str], prefix: str = "w", log_dir: Path | None = None) -> None:
        self.argv, self.log_dir = argv, log_dir
        self.names = self.names_for(count, prefix)
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = threading.Event()
        for name in self.names:
            self._start(name)
        threading.Thread(target=self._supervise, name="workers", daemon=True).start()

    @staticmethod
    def names_for(count: int, prefix: str = "w") -> list[str]:
        """The ids of the ``count`` workers serve starts (each logs in with ``workers/<id>.toml`` where
        the config logs in as someone: :mod:`cloud_aggregator.worker_login`)."""
        return [f"{prefix}{i}" for i in range(1, count + 1)]

    def _start(self, name: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "cloud_aggregator.cli",
            "--log-level",
            logging.getLevelName(log.getEffectiveLevel()),
        ]
        out = None if self.log_dir is None else (self.log_dir / f"worker-{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [*cmd, "worker", *self.argv, "--id", name], stdout=out, stderr=out
        )
        if out is not None:
            out.close()
        log.info("worker %s started (pid %d)", name, self.procs[name].pid)

    def _supervise(self) -> None:
        while not self._stop.wait(RESTART_S):
            for name, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stop.is_set():
                    log.warning(
                        "worker %s (pid %d) exited with %s; starting it again",
                        name,
                        proc.pid,
                        proc.returncode,
                    )
                    self._start(name)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- the command ---------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser(
        "worker",
        help="one of [collect] workers: admit and fold a share of the fleet's uploads for serve",
    )
    w.add_argument(
        "--config",
        type=Path,
        required=True,
        help="the aggregator TOML serve runs on; the worker logs in with workers/<id>.toml beside it "
        "(fleet add-worker) where the config logs in as someone",
    )
    w.add_argument("--broker", help="mqtt://host:port or mqtts://host:port (overrides the config)")
    w.add_argument("--allow-plaintext", action="store_true")
    w.add_argument("--id", default=f"w{os.getpid()}", help="this worker's name, unique in the fleet")
    w.add_argument(
        "--plant",
        action="store_true",
        help="a plant's partial aggregator (--broker: the plant's): one batch per round crosses the bridge",
    )
    w.set_defaults(func=_worker)


def _worker(args: argparse.Namespace) -> int:
    try:
        codec.check_id("worker", args.id)  # before it names a login file
        raw, own = worker_login.with_login(load_toml(args.config), args.config, args.id)
        who = worker_login.raw_identity(raw)
        if not own and not args.plant and who is not None:  # a plant worker's config is its own login
            refusal = worker_login.missing_logins(who, args.config, [args.id])
            print(refusal, file=sys.stderr)
            return 2
        if args.broker:
            raw["broker"] = args.broker
        if args.allow_plaintext:
            raw["allow_plaintext"] = True
        cfg = build(AggregatorConfig, raw, str(args.config))
    except ConfigError as exc:
        print(f"invalid configuration in {args.config}: {'; '.join(exc.errors)}", file=sys.stderr)
        return 2
    except codec.WireError as exc:
        print(f"--id: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        run_worker(cfg, args.id, stop, plant=args.plant)
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, before)
    return 0

"""``cloud-aggregator serve``: orchestrate the configured tasks' rounds over MQTT.

Before anything connects or writes, every configured task is checked against the store
(:meth:`cloud_aggregator.store.sqlite.SqliteStore.check_task`): a task may gain rounds and keep
its history; any other change of its spec is refused in one line that names the changed
fields (:class:`ServeRefusedError`), and ``restart`` (``serve --restart TASK``) deletes that
one task's history, saying what it deletes, and starts it afresh.

Tasks whose devices cannot overlap (``devices = { kind = ... }`` or disjoint ``ids``) run
side by side, each on its own thread (:mod:`cloud_aggregator.serve.task_lanes`); the others take
turns in config order.  Run once, ``serve`` returns when its tasks are done.  As a service (``serve --service``)
it stays up after that and takes new or extended tasks from its config on ``SIGHUP``
(:class:`Control`): the re-read config is validated as at start-up, and a bad edit is
refused in one line while the running tasks go on.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from cloud_aggregator import worker_login
from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.config import AggregatorConfig, TaskConfig
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.types import CollectRequest, RoundRecord
from cloud_aggregator.serve.buffered_mqtt import BufferedTask
from cloud_aggregator.serve.coordinator import WorkerFleet
from cloud_aggregator.serve.home_assistant import DiscoveryRelay
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
from cloud_aggregator.serve.secagg_round import SecAggFleet
from cloud_aggregator.serve.singleton import claim_fleet, lock_will
from cloud_aggregator.serve.task_lanes import run_side_by_side
from cloud_aggregator.serve.watchdog import WatchedSession, wait_pinging
from cloud_aggregator.serve.workers import LocalWorkers
from cloud_aggregator.store.backup import BACKUPS, Backups, StoreDamagedError, check_store
from cloud_aggregator.store.sqlite import SqliteStore, TaskChangedError
from ioft_protocol.config import ConfigError
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import SessionOptions
from ioft_protocol.service import Notifier
from trainer_lite.params import param_hash

log = logging.getLogger(__name__)


class ServeRefusedError(ValueError):
    """An operator's config that ``serve`` refuses before it connects or writes; one line."""


class Terminated(BaseException):
    """Raised in the main thread by the ``SIGTERM`` handler: stop now (each round is saved as it ends)."""


@dataclass
class Control:
    """How a running ``serve --service`` is asked to re-read its config.

    Attributes
    ----------
    reload
        Reads and validates the config again (raises ``ConfigError``); ``None``: no reloads.
    reload_requested
        Set by the ``SIGHUP`` handler; a watcher thread then calls ``reload``.
    """

    reload: Callable[[], AggregatorConfig] | None = None
    reload_requested: threading.Event = field(default_factory=threading.Event)


def open_session(cfg: AggregatorConfig, notifier: Notifier | None = None) -> MqttSession:
    # A persistent session: uplinks sent while we reconnect are queued by the broker.
    # A round's burst (an upload and a status per device) must fit the inbound queue.
    inbound = max(10_000, 4 * len(cfg.collect.expected))
    options = SessionOptions.for_login(
        cfg, cfg.client_id, clean_session=False, will=lock_will(cfg.fleet), inbound_limit=inbound
    )
    return WatchedSession(options, notifier or Notifier())  # its reads ping systemd's watchdog


def format_record(rec: RoundRecord, metric: str = "test_loss") -> str:
    cells = " ".join(f"{d}={m.get(metric, float('nan')):.4f}" for d, m in sorted(rec.metrics.items()))
    mean = rec.mean_metric(metric)
    mean_s = "n/a" if mean is None else f"{mean:.4f}"
    accuracy = rec.mean_metric("test_accuracy")  # classification tasks
    extra = "" if accuracy is None else f" test_accuracy mean={accuracy:.4f}"
    extra += f" rejected={sorted(rec.rejected)}" if rec.rejected else ""
    for device, score in sorted(rec.extra.get("holdout", {}).items()):
        extra += f" holdout {device}: " + " ".join(f"{k}={v:.4f}" for k, v in sorted(score.items()))
    if rec.extra.get("late"):
        extra += f" late={rec.extra['late']}"
    return (
        f"[{rec.task}] round {rec.round:>3} {rec.phase:<7} {rec.status:<9} n={len(rec.participants)} "
        f"{metric} mean={mean_s} {cells}{extra} ({rec.finished - rec.started:.2f}s)"
    )


def check_tasks(store: SqliteStore, tasks: list[TaskConfig], restart: Callable[[str], bool]) -> None:
    """Refuse every task whose spec changed in a way that voids its stored history.

    Raises
    ------
    ServeRefusedError
        One line naming each refused task, its changed fields and the way forward.
    """
    refused = []
    for task in tasks:
        if restart(task.name):
            continue
        try:
            store.check_task(task.name, task.spec().to_json())
        except TaskChangedError as exc:
            refused.append(str(exc))
    if refused:
        raise ServeRefusedError("; ".join(refused))


def register_tasks(store: SqliteStore, tasks: list[TaskConfig], restart: Callable[[str], bool]) -> None:
    """Record each task's spec; a restarted one loses its history, after a line saying what."""
    for task in tasks:
        spec = task.spec()
        if restart(task.name):
            stored = store.task_spec(task.name)
            what = (
                "nothing was stored" if stored is None else f"deleting {store.history(task.name).describe()}"
            )
            log.warning("task %s: --restart: %s; starting it afresh", task.name, what)
        if store.register_task(spec.name, spec.to_json(), restart=restart(task.name)):
            log.info("task %s: resuming from the stored state", spec.name)


def _one_line(exc: Exception) -> str:
    if isinstance(exc, ConfigError):
        return "; ".join(exc.errors)
    return str(exc).replace("\n", " ")


def _settings_changed(old: AggregatorConfig, new: AggregatorConfig) -> list[str]:
    return [
        f.name
        for f in fields(old)
        if f.name not in ("task", "restart", "resume_from_devices")
        and getattr(old, f.name) != getattr(new, f.name)
    ]


def _watch_reloads(
    control: Control, store: SqliteStore, cfg: AggregatorConfig, accepted: queue.Queue[AggregatorConfig]
) -> None:
    """Serve ``SIGHUP``s: validate the re-read config; queue it, or refuse it in one line."""
    assert control.reload is not None
    while True:
        control.reload_requested.wait()
        control.reload_requested.clear()
        try:
            new = control.reload()
            check_tasks(store, new.task, lambda _: False)
        except (ConfigError, ServeRefusedError, ValueError, OSError) as exc:
            log.error("SIGHUP: config refused, the running tasks go on: %s", _one_line(exc))
            continue
        changed = _settings_changed(cfg, new)
        if changed:
            log.warning("SIGHUP: %s changed; they apply when serve is started again", ", ".join(changed))
        log.info("SIGHUP: config accepted: tasks %s", [t.name for t in new.task])
        accepted.put(new)


def serve(
    cfg: AggregatorConfig,
    control: Control | None = None,
    *,
    service: bool = False,
    notifier: Notifier | None = None,
    worker_argv: list[str] | None = None,
) -> None:
    """Run every configured task to completion (resuming where a previous run stopped).

    Parameters
    ----------
    cfg
        The validated config; ``cfg.restart`` names the tasks to start afresh.
    control
        Reloads on ``SIGHUP`` (service mode).
    service
        Keep running when the tasks are done and take new or extended tasks from each
        reload, until ``SIGTERM`` (:class:`Terminated`).
    notifier
        systemd's notify socket (default: from the environment; a no-op outside a unit):
        READY once the fleet is claimed, watchdog pings from the loops that read the broker
        (:mod:`cloud_aggregator.serve.watchdog`), STOPPING.
    worker_argv
        ``cloud-aggregator worker``'s arguments (the config and overrides) for the workers
        ``[collect] workers`` > 1 starts here.

    Raises
    ------
    ServeRefusedError
        A task's spec changed in a way that voids its stored history (nothing was written).
    """
    control = control or Control()
    notifier = notifier or Notifier.from_env()
    _check_worker_logins(cfg, worker_argv)
    store = open_store(cfg)
    session: MqttSession | None = None
    local: LocalWorkers | None = None
    try:
        check_tasks(store, cfg.task, cfg.restarts)  # all refusals at once, before any write
        register_tasks(store, cfg.task, cfg.restarts)
        accepted: queue.Queue[AggregatorConfig] = queue.Queue()
        if service and control.reload is not None:
            threading.Thread(
                target=_watch_reloads, args=(control, store, cfg, accepted), name="reload", daemon=True
            ).start()
        session = open_session(cfg, notifier)
        claim_fleet(session, cfg.fleet)  # retries until the broker is there; refuses a second aggregator
        notifier.ready(f"fleet {cfg.fleet}: connected to {cfg.broker}")
        c = cfg.collect
        policy = CollectPolicy(
            deadline_s=c.deadline_s,
            min_participants=c.min_participants,
            max_extensions=c.max_extensions,
            expected=tuple(c.expected),
            startup_wait_s=c.startup_wait_s,
            liveness_s=c.liveness_s,
            max_payload_bytes=cfg.max_payload_bytes,
            checkpoint_every=c.checkpoint_every,
        )
        if c.workers > 1 or c.plant_workers:  # K workers share the uplink; this process coordinates (README)
            # At workers = 1 with plant workers: the plants' batches only, no cloud worker.
            expected = (c.workers if c.workers > 1 else 0) + len(c.plant_workers)
            fleet = WorkerFleet(
                session, cfg.fleet, policy, store, admission=cfg.admission.policy(), workers=expected
            )
            if c.spawn_workers and c.workers > 1:
                if not worker_argv:
                    raise ServeRefusedError(
                        "[collect] workers needs serve --config: the workers it starts read the same file "
                        "(or set spawn_workers = false and run `cloud-aggregator worker --config ...`)"
                    )
                local = LocalWorkers(c.workers, worker_argv)
        else:
            fleet = MqttFleet(session, cfg.fleet, policy, store, admission=cfg.admission.policy())
        if hasattr(session, "tap"):  # the devices' Home Assistant configs, rebuilt (not a test's fake)
            DiscoveryRelay(session, cfg.fleet).attach()
        fleet.selections.update({t.name: t.devices for t in cfg.task})  # which devices run each task
        fleet.holdouts.update({t.name: t.holdout for t in cfg.task})
        online = fleet.wait_for_devices()
        log.info("fleet %s: %d online at start: %s", cfg.fleet, len(online), online)
        tasks = list(cfg.task)
        while True:
            run_side_by_side(tasks, lambda task: _run_task(task, fleet, store, cfg))
            if not service:
                return
            log.info("all tasks done; waiting for new or extended tasks (SIGHUP re-reads the config)")
            notifier.status("all tasks done; waiting for new or extended tasks (systemctl reload)")
            new = wait_pinging(accepted, notifier)
            tasks = [t for t in new.task if store.next_round(t.name) <= t.rounds]
            fleet.selections.update({t.name: t.devices for t in tasks})
            fleet.holdouts.update({t.name: t.holdout for t in tasks})
            try:
                register_tasks(store, tasks, lambda _: False)
            except TaskChangedError as exc:  # the store moved on since the watcher checked
                log.error("SIGHUP: config refused, the running tasks go on: %s", exc)
                tasks = []
    finally:
        if local is not None:
            local.stop()
        notifier.stopping()
        if session is not None:
            session.stop(final=lock_will(cfg.fleet))  # clear our lock
        store.close()


def open_store(cfg: AggregatorConfig) -> SqliteStore:
    """The store, checked first (a damaged one is refused in one line) and backed up as rounds are saved."""
    path = Path(cfg.state_dir) / "aggregator.sqlite"
    backups = Backups(path.parent / BACKUPS, cfg.store.backup_every, cfg.store.backup_keep)
    try:
        check_store(path)
        return SqliteStore(path, backups=backups)
    except (StoreDamagedError, sqlite3.DatabaseError) as exc:
        raise ServeRefusedError(
            str(exc) if isinstance(exc, StoreDamagedError) else f"{path}: {exc}"
        ) from None


def _check_worker_logins(cfg: AggregatorConfig, worker_argv: list[str] | None) -> None:
    """Refuse (before connecting) to start workers that would log in as serve's own identity: the
    broker makes a login's identity its client id, so they would take over each other's connection."""
    c = cfg.collect
    if c.workers < 2 or not c.spawn_workers or not worker_argv or "--config" not in worker_argv:
        return
    config = Path(worker_argv[worker_argv.index("--config") + 1])
    who = worker_login.identity(cfg.username, cfg.tls.cert_file if cfg.tls else None)
    refusal = worker_login.missing_logins(who, config, LocalWorkers.names_for(c.workers))
    if refusal is not None:
        raise ServeRefusedError(f"[collect] workers = {c.workers}: {refusal}")


def _devices_round(task: str, fleet: MqttFleet, store: SqliteStore) -> int:
    """The round past every device's last one of ``task`` (``serve --resume-from-devices``), from
    their statuses; 1 when none trained it."""
    trained = fleet.view.trained_rounds(task)
    if not trained:
        log.warning("task %s: --resume-from-devices: no device online reports a round of it", task)
        return 1
    top = max(trained.values())
    if top >= store.next_round(task):
        log.info("task %s: --resume-from-devices: devices trained up to round %d (%s)", task, top,
                 ", ".join(f"{d}={r}" for d, r in sorted(trained.items())[:20]))  # fmt: skip
    return top + 1


def _run_task(task: TaskConfig, fleet: MqttFleet, store: SqliteStore, cfg: AggregatorConfig) -> None:
    spec = task.spec()
    if store.next_round(spec.name) > spec.rounds:
        log.info("task %s: all %d rounds are done", spec.name, spec.rounds)
        return
    if task.mode == "buffered":  # FedBuff: cloud_aggregator/serve/buffered_mqtt.py
        runner = BufferedTask(
            spec,
            task.buffer_config(),
            fleet,
            store,
            admission=cfg.admission.policy(),
            on_record=lambda rec: log.info("%s", format_record(rec)),
        )
        final = runner.run()
        fleet.finish(CollectRequest(spec, spec.rounds, "done", final, param_hash(final), {}, {}))
        log.info(
            "task %s done: %d buffer applications, final global %s",
            spec.name,
            spec.rounds,
            param_hash(final)[:12],
        )
        return
    c = cfg.collect
    engine = RoundEngine(
        spec,
        # SecAgg: cloud_aggregator/serve/secagg_round.py; a certificate fleet's devices sign their keys by default
        fleet
        if spec.secagg is None
        else SecAggFleet(fleet, certificates=bool(cfg.tls and cfg.tls.cert_file)),
        strategy=make_strategy(spec),
        store=store,
        min_participants=c.min_participants,
        on_record=lambda rec: log.info("%s", format_record(rec)),
        straggler=c.straggler,
        staleness_weight=c.staleness_weight,
        start_round=_devices_round(spec.name, fleet, store) if cfg.resume_from_devices else 1,
    )
    final = engine.run()
    fleet.finish(CollectRequest(spec, spec.rounds, "done", final, param_hash(final), {}, {}))
    log.info("task %s done: %d rounds, final global %s", spec.name, spec.rounds, param_hash(final)[:12])

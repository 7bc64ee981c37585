"""``cloud-aggregator serve``: orchestrate the configured tasks' rounds over MQTT."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.mqtt_fleet import CollectPolicy, MqttFleet
from cloud_aggregator.rounds import CollectRequest, RoundEngine, RoundRecord
from cloud_aggregator.store import SqliteStore
from cloud_aggregator.stragglers import check_next_round
from cloud_aggregator.strategies import make_strategy
from ioft_protocol.mqtt import MqttSession, SessionOptions
from trainer_lite.params import param_hash

log = logging.getLogger(__name__)


def open_session(cfg: AggregatorConfig) -> MqttSession:
    # A persistent session: uplinks sent while we reconnect are queued by the broker.
    return MqttSession(SessionOptions.for_login(cfg, cfg.client_id, clean_session=False))


def format_record(rec: RoundRecord, metric: str = "test_loss") -> str:
    cells = " ".join(f"{d}={m.get(metric, float('nan')):.4f}" for d, m in sorted(rec.metrics.items()))
    mean = rec.mean_metric(metric)
    mean_s = "n/a" if mean is None else f"{mean:.4f}"
    extra = f" rejected={sorted(rec.rejected)}" if rec.rejected else ""
    if rec.extra.get("late"):
        extra += f" late={rec.extra['late']}"
    return (
        f"[{rec.task}] round {rec.round:>3} {rec.phase:<7} {rec.status:<9} n={len(rec.participants)} "
        f"{metric} mean={mean_s} {cells}{extra} ({rec.finished - rec.started:.2f}s)"
    )


def serve(cfg: AggregatorConfig, stop: threading.Event | None = None) -> None:
    """Run every configured task to completion (resuming where a previous run stopped)."""
    stop = stop or threading.Event()
    if cfg.collect.straggler == "next_round":  # refuse before any round starts, not mid-run
        for task in cfg.task:
            check_next_round(make_strategy(task.spec()))
    store = SqliteStore(Path(cfg.state_dir) / "aggregator.sqlite")
    session = open_session(cfg)
    session.start(timeout=30.0)
    c = cfg.collect
    policy = CollectPolicy(
        deadline_s=c.deadline_s,
        min_participants=c.min_participants,
        max_extensions=c.max_extensions,
        expected=tuple(c.expected),
        startup_wait_s=c.startup_wait_s,
        max_payload_bytes=cfg.max_payload_bytes,
    )
    fleet = MqttFleet(session, cfg.fleet, policy, store, admission=cfg.admission.policy())
    try:
        online = fleet.wait_for_devices()
        log.info("fleet %s: %d devices online: %s", cfg.fleet, len(online), online)
        for task in cfg.task:
            if stop.is_set():
                break
            spec = task.spec()
            resumed = store.register_task(spec.name, spec.to_json(), restart=cfg.restart)
            if resumed:
                log.info("task %s: resuming from the stored state", spec.name)
            strategy = make_strategy(spec)
            engine = RoundEngine(
                spec,
                fleet,
                strategy=strategy,
                store=store,
                min_participants=c.min_participants,
                on_record=lambda rec: log.info("%s", format_record(rec)),
                straggler=c.straggler,
                staleness_weight=c.staleness_weight,
            )
            final = engine.run()
            fleet.finish(CollectRequest(spec, spec.rounds, "done", final, param_hash(final), {}, {}))
            log.info(
                "task %s done: %d rounds, final global %s", spec.name, spec.rounds, param_hash(final)[:12]
            )
        time.sleep(0.2)
    finally:
        session.stop()
        store.close()

"""Prometheus metrics of a fleet, computed at scrape time from a :class:`FleetView`.

A custom collector instead of counters bumped in the round loop: the figures are
already in the store (rounds, their durations, admitted and refused uploads, rollout
states) and in the retained statuses (devices online, rows, sensor state, CPU per
round, RSS), so a scrape reads them there and the aggregator's hot path carries no
instrumentation at all.  Counters are totals since the task began (the store's
history), so they survive aggregator restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cloud_aggregator.console.fleet_view import FleetView, number
from cloud_aggregator.rounds.types import Reason

#: Round duration buckets, seconds (a simulated round takes ~0.1 s, a deadline wait tens).
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class FleetCollector(Collector):
    """Yields the fleet's metrics from ``view()`` (called once per scrape)."""

    def __init__(self, view: Callable[[], FleetView]) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        v = self.view()
        yield from _round_metrics(v)
        yield from _upload_metrics(v)
        yield from _device_metrics(v)
        yield from _broker_metrics(v)
        yield from _rollout_metrics(v)


def _round_metrics(v: FleetView) -> Iterator[Metric]:
    rounds = CounterMetricFamily(
        "ioft_rounds", "Rounds (phases) recorded per task, by how they ended", labels=["task", "status"]
    )
    waits = CounterMetricFamily(
        "ioft_round_deadline_waits",
        "Rounds that closed at their deadline instead of when every device answered",
        labels=["task"],
    )
    duration = HistogramMetricFamily(
        "ioft_round_duration_seconds", "Wall time of a round, announce to record", labels=["task"]
    )
    for task, records in sorted(v.store.rounds.items()):
        for status in ("completed", "abandoned"):
            rounds.add_metric([task, status], sum(r.status == status for r in records))
        waits.add_metric([task], sum(r.extra.get("closed") == "deadline" for r in records))
        counts = [0] * len(DURATION_BUCKETS)
        total = 0.0
        for r in records:
            took = max(0.0, r.finished - r.started)
            total += took
            for i, edge in enumerate(DURATION_BUCKETS):
                if took <= edge:
                    counts[i] += 1
        buckets = [(f"{e:g}", c) for e, c in zip(DURATION_BUCKETS, counts, strict=True)]
        duration.add_metric([task], [*buckets, ("+Inf", len(records))], total)
    yield from (rounds, waits, duration)


def _upload_metrics(v: FleetView) -> Iterator[Metric]:
    admitted = CounterMetricFamily(
        "ioft_uploads_admitted", "Uploads aggregated into a round, per task", labels=["task"]
    )
    refused = CounterMetricFamily(
        "ioft_uploads_refused",
        "Uploads admission refused, per task and reason code",
        labels=["task", "reason"],
    )
    resent = CounterMetricFamily(
        "ioft_uploads_resent",
        "Copies of uploads already counted (a redelivery, a restarted device's re-send): routine, not refused",
        labels=["task"],
    )
    for task, records in sorted(v.store.rounds.items()):
        admitted.add_metric([task], sum(len(r.participants) for r in records))
    for task, per_device in sorted(v.store.refused.items()):
        by_reason: dict[str, int] = {}
        for reasons in per_device.values():
            for reason, n in reasons.items():
                by_reason[reason] = by_reason.get(reason, 0) + n
        resent.add_metric([task], by_reason.pop(Reason.RESENT, 0))
        for reason, n in sorted(by_reason.items()):
            refused.add_metric([task, reason], n)
    yield from (admitted, refused, resent)


def _device_metrics(v: FleetView) -> Iterator[Metric]:
    devices = v.devices()
    online = GaugeMetricFamily("ioft_devices_online", "Devices whose retained status says online")
    online.add_metric([], sum(f.online for f in devices))
    up = GaugeMetricFamily("ioft_device_online", "1 while the device is online", labels=["device", "kind"])
    seen = GaugeMetricFamily(
        "ioft_device_last_seen_timestamp_seconds", "When the device last wrote its status", labels=["device"]
    )
    rows = GaugeMetricFamily("ioft_device_rows", "Local dataset rows", labels=["device", "split"])
    fault = GaugeMetricFamily(
        "ioft_device_sensor_fault", "1 while the device's recorder reports a sensor fault", labels=["device"]
    )
    cpu = GaugeMetricFamily(
        "ioft_device_round_cpu_seconds", "CPU seconds the device spent on its last round", labels=["device"]
    )
    rss = GaugeMetricFamily("ioft_device_max_rss_bytes", "Peak RSS of the device daemon", labels=["device"])
    model = GaugeMetricFamily(
        "ioft_device_model_version", "Active version of each pushed model", labels=["device", "model"]
    )
    paused = GaugeMetricFamily(
        "ioft_device_paused", "1 while the device's owner has paused its taking part", labels=["device"]
    )
    refused = GaugeMetricFamily(
        "ioft_device_tasks_refused", "Tasks the device refuses to run (see its status)", labels=["device"]
    )
    for f in devices:
        up.add_metric([f.device, f.kind or ""], float(f.online))
        if f.last_seen is not None:
            seen.add_metric([f.device], f.last_seen)
        for split, n in f.rows.items():
            rows.add_metric([f.device, split], n)
        if f.sensor is not None:
            fault.add_metric([f.device], float(f.sensor == "fault"))
        if f.cpu_s_round is not None:
            cpu.add_metric([f.device], f.cpu_s_round)
        if f.max_rss_bytes is not None:
            rss.add_metric([f.device], f.max_rss_bytes)
        for name, version in f.models.items():
            model.add_metric([f.device, name], version)
        refused.add_metric([f.device], len(f.refused_tasks))
        paused.add_metric([f.device], float(f.paused is not None))
    yield from (online, up, seen, rows, fault, cpu, rss, model, paused, refused)


def _broker_metrics(v: FleetView) -> Iterator[Metric]:
    """Bytes through the broker (all clients; mosquitto's ``$SYS`` counters), where it reports them."""
    for key, what in (("bytes_received", "received by"), ("bytes_sent", "sent by")):
        family = CounterMetricFamily(f"ioft_broker_{key}", f"Bytes {what} the broker since it started")
        if (n := number(v.broker.get(key))) is not None:
            family.add_metric([], n)
        yield family


def _rollout_metrics(v: FleetView) -> Iterator[Metric]:
    """Rollouts by state, from any ``rollout*`` table of the store that has a ``state`` column."""
    family = GaugeMetricFamily("ioft_rollouts", "Model rollouts by state", labels=["state"])
    states: dict[str, int] = {}
    for columns, rows in v.store.rollouts.values():
        if "state" not in columns:
            continue
        i = columns.index("state")
        for row in rows:
            states[str(row[i])[:40]] = states.get(str(row[i])[:40], 0) + 1
    for state, n in sorted(states.items()):
        family.add_metric([state], n)
    yield family

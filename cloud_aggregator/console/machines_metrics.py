"""Prometheus metrics of the machines at work, per device and task, at scrape time.

From the machines view (:func:`cloud_aggregator.console.machines_view.machines_json`): the latest
answer's values (a layer's expected and commanded speed and residual, a weld's class
probabilities), its latency, the speed advice, field accuracy or error and the drift flag,
open alerts per rule, the answers and refusals the device counts, its Moonraker calls, and which
candidate model serves with each candidate's score on the device's newest rows.  Speeds are in
mm/s and say so in their names (``_mm_per_second``).

What a device counts (answers, refusals, Moonraker calls) are ``_total`` counters with the value
the device counted, and a ``_created`` of when it began counting (``serving.counting_since``):
they start again from 0 when its trainer restarts, as any process's counters do, and
Prometheus' ``rate``/``increase`` carry over such a reset.  Not an offset kept here to make them
never go down: that would vanish when the console restarts, differ between two consoles, and
could not know what the device counted between the last scrape and its restart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cloud_aggregator.console.fleet_status import number


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=["device", "task", *labels])


def _counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
    return CounterMetricFamily(
        name, f"{doc}, since the device's trainer started (_created)", labels=[*labels]
    )


class MachinesCollector(Collector):
    """Yields the machines' gauges from ``machines()`` (called once per scrape)."""

    def __init__(self, machines: Callable[[], list[dict[str, Any]]]) -> None:
        self.machines = machines

    def collect(self) -> Iterator[Metric]:
        g, counts, moonraker = _gauges(), _counters(), _moonraker_counters()
        refused = GaugeMetricFamily("ioft_moonraker_apply_refused", "1 while the advice is not applied (see the status)", labels=["device"])  # fmt: skip
        for m in self.machines():
            d, since = m["device"], m.get("counting_since")
            for k, family in moonraker.items():
                if (v := number((m.get("moonraker") or {}).get(k))) is not None:
                    family.add_metric([d], v, created=since)
            if m.get("moonraker") is not None:
                refused.add_metric([d], float(m["moonraker"]["refused"] is not None))
            for a in m["alerts"]:
                g["alerts"].add_metric([d, a.get("task") or "", a["rule"]], float(a["state"] == "raised"))
            for t in m["tasks"]:
                labels = [d, t["task"]]
                _task(g, labels, t)
                if (n := number(t["answered"])) is not None:
                    counts["answered"].add_metric(labels, n, created=since)
                for reason, n in sorted(t["refused"].items()):
                    counts["refused"].add_metric([*labels, reason], n, created=since)
        yield from g.values()
        yield from counts.values()
        yield from moonraker.values()
        yield refused


def _gauges() -> dict[str, GaugeMetricFamily]:
    """The per-task gauges: the latest answer, the advice, the field figures, alerts and the serving model."""
    return {
        "expected": _gauge("ioft_answer_expected_speed_mm_per_second", "Latest answer: the speed the printer's model expects at the layer's vibration"),
        "commanded": _gauge("ioft_answer_commanded_speed_mm_per_second", "Latest answer: the layer's commanded speed"),
        "residual": _gauge("ioft_answer_residual_mm_per_second", "Latest answer: expected minus commanded speed"),
        "prob": _gauge("ioft_answer_probability", "Latest answer: the probability of each class (welds)", "class"),
        "latency": _gauge("ioft_answer_latency_seconds", "Latest answer: seconds from the row's features to its answer"),
        "at": _gauge("ioft_answer_timestamp_seconds", "Latest answer: when it was made"),
        "advice": _gauge("ioft_speed_advice_mm_per_second", "The highest speed whose expected vibration stays within the budget"),
        "accuracy": _gauge("ioft_field_accuracy", "Field accuracy of the serving model over its last scored answers (welds)"),
        "error": _gauge("ioft_field_error_mm_per_second", "Field error of the serving model over its last scored answers (layers)"),
        "reference_accuracy": _gauge("ioft_field_reference_accuracy", "The serving model's own test-split accuracy the field one is held against (welds)"),
        "reference_error": _gauge("ioft_field_reference_error_mm_per_second", "The serving model's own test-split error the field one is held against (layers)"),
        "drift": _gauge("ioft_field_drift", "1 while the field figure is worse than the model's test-split one by the margin"),
        "awaiting": _gauge("ioft_field_awaiting_labels", "Answers waiting for their label"),
        "coverage": _gauge("ioft_field_coverage", "Fraction of the last scored answers whose conformal interval or set held the truth"),
        "alerts": _gauge("ioft_alerts_open", "1 while the rule's alert is raised, 0 once cleared", "rule"),
        "round": _gauge("ioft_serving_model_round", "The round of the model that serves the task"),
        "candidate": _gauge("ioft_serving_candidate", "1 for the candidate model that serves the task (personal, global, alone), 0 for the others", "candidate"),
        "score": _gauge("ioft_serving_candidate_score", "Each candidate's score (accuracy, or R²) on the device's newest held-out rows", "candidate"),
        "judged": _gauge("ioft_serving_judged_rows", "The newest rows the candidates were judged on"),
    }  # fmt: skip


def _counters() -> dict[str, CounterMetricFamily]:
    """Rows answered and refused, per device and task."""
    return {
        "answered": _counter("ioft_answers", "Rows answered", "device", "task"),
        "refused": _counter("ioft_answers_refused", "Rows refused an answer, by reason", "device", "task", "reason"),
    }  # fmt: skip


def _moonraker_counters() -> dict[str, CounterMetricFamily]:
    """What each printer's Moonraker did with the speed advice."""
    return {
        k: _counter(f"ioft_moonraker_{k}", doc, "device")
        for k, doc in (
            ("sent", "Speed advice the printer's Moonraker took (read back after)"),
            ("failed", "Moonraker calls that failed after their retries"),
            ("restored", "Times the printer's own max_velocity was put back"),
            ("readback_mismatch", "Changes the toolhead's max_velocity did not show when read back"),
            ("dropped", "Moonraker requests dropped because the worker was behind"),
        )
    }


def _task(g: dict[str, GaugeMetricFamily], labels: list[str], t: dict[str, Any]) -> None:
    def put(name: str, value: Any, *extra: str) -> None:
        if (v := number(value)) is not None:
            g[name].add_metric([*labels, *extra], v)

    latest = t["latest"] or {}
    for name, field in (("expected", "expected_speed"), ("commanded", "commanded"), ("residual", "residual")):
        put(name, latest.get(field))
    for cls, p in zip(latest.get("classes") or [], latest.get("probabilities") or [], strict=False):
        put("prob", p, cls)
    put("latency", latest.get("latency_s"))
    put("at", latest.get("answered_at"))
    put("advice", t["advice"])
    field = t["field"] or {}
    metric = "accuracy" if field.get("metric") == "accuracy" else "error"
    put(metric, field.get("value"))
    put(f"reference_{metric}", field.get("reference"))
    if isinstance(field.get("drift"), bool):
        put("drift", float(field["drift"]))
    put("awaiting", field.get("awaiting_labels"))
    put("coverage", field.get("coverage_value"))
    put("round", t["model"].get("round"))
    ev = t.get("evidence") or {}
    serving = t["model"].get("candidate")
    for name, score in sorted((ev.get("scores") or {}).items()):
        put("candidate", float(name == serving), name)
        put("score", score, name)
    put("judged", ev.get("rows"))

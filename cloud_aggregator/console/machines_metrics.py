"""Prometheus gauges of the machines at work, per device and task, at scrape time.

From the machines view (:func:`cloud_aggregator.console.machines_view.machines_json`): the latest
answer's values (a layer's expected and commanded speed and residual, a weld's class
probabilities), its latency, the speed advice, field accuracy or error and the drift flag,
open alerts, the answers and refusals the device counts, and which candidate model serves with
each candidate's score on the device's newest rows.  Gauges, not counters: a device's own
counts start again when it restarts.  The exception: the speed advice's Moonraker calls (sent,
failed, restored, read back wrong, dropped) are ``_total`` counters, whose rates Prometheus
takes across such restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cloud_aggregator.console.fleet_status import number


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=["device", "task", *labels])


class MachinesCollector(Collector):
    """Yields the machines' gauges from ``machines()`` (called once per scrape)."""

    def __init__(self, machines: Callable[[], list[dict[str, Any]]]) -> None:
        self.machines = machines

    def collect(self) -> Iterator[Metric]:
        g = {
            "expected": _gauge("ioft_answer_expected_speed", "Latest answer: the speed (mm/s) the printer's model expects at the layer's vibration"),
            "commanded": _gauge("ioft_answer_commanded_speed", "Latest answer: the layer's commanded speed (mm/s)"),
            "residual": _gauge("ioft_answer_residual", "Latest answer: expected minus commanded speed (mm/s)"),
            "prob": _gauge("ioft_answer_probability", "Latest answer: the probability of each class (welds)", "class"),
            "latency": _gauge("ioft_answer_latency_seconds", "Latest answer: seconds from the row's features to its answer"),
            "at": _gauge("ioft_answer_timestamp_seconds", "Latest answer: when it was made"),
            "advice": _gauge("ioft_speed_advice", "The highest speed (mm/s) whose expected vibration stays within the budget"),
            "accuracy": _gauge("ioft_field_accuracy", "Field accuracy of the serving model over its last scored answers (welds)"),
            "error": _gauge("ioft_field_error", "Field error (mm/s) of the serving model over its last scored answers (layers)"),
            "reference": _gauge("ioft_field_reference", "The serving model's own test-split figure the field one is held against"),
            "drift": _gauge("ioft_field_drift", "1 while the field figure is worse than the model's test-split one by the margin"),
            "awaiting": _gauge("ioft_field_awaiting_labels", "Answers waiting for their label"),
            "coverage": _gauge("ioft_field_coverage", "Fraction of the last scored answers whose conformal interval or set held the truth"),
            "alerts": _gauge("ioft_alerts_open", "Open alerts (raised, not yet cleared)"),
            "answered": _gauge("ioft_answers", "Rows answered since the device's trainer started"),
            "refused": _gauge("ioft_answers_refused", "Rows refused an answer since the trainer started, by reason", "reason"),
            "round": _gauge("ioft_serving_model_round", "The round of the model that serves the task"),
            "candidate": _gauge("ioft_serving_candidate", "1 for the candidate model that serves the task (personal, global, alone), 0 for the others", "candidate"),
            "score": _gauge("ioft_serving_candidate_score", "Each candidate's score (accuracy, or R²) on the device's newest held-out rows", "candidate"),
            "judged": _gauge("ioft_serving_judged_rows", "The newest rows the candidates were judged on"),
        }  # fmt: skip
        moonraker = {
            k: CounterMetricFamily(f"ioft_moonraker_{k}", doc, labels=["device"])
            for k, doc in (
                ("sent", "Speed advice the printer's Moonraker took (read back after)"),
                ("failed", "Moonraker calls that failed after their retries"),
                ("restored", "Times the printer's own max_velocity was put back"),
                ("readback_mismatch", "Changes the toolhead's max_velocity did not show when read back"),
                ("dropped", "Moonraker requests dropped because the worker was behind"),
            )
        }
        refused = GaugeMetricFamily("ioft_moonraker_apply_refused", "1 while the advice is not applied (see the status)", labels=["device"])  # fmt: skip
        for m in self.machines():
            d = m["device"]
            for k, family in moonraker.items():
                if (v := number((m.get("moonraker") or {}).get(k))) is not None:
                    family.add_metric([d], v)
            if m.get("moonraker") is not None:
                refused.add_metric([d], float(m["moonraker"]["refused"] is not None))
            open_by_task: dict[str, int] = {t["task"]: 0 for t in m["tasks"]}
            for a in m["alerts"]:
                if a["state"] == "raised":
                    task = a.get("task") or ""
                    open_by_task[task] = open_by_task.get(task, 0) + 1
            for task, n in sorted(open_by_task.items()):
                g["alerts"].add_metric([d, task], n)
            for t in m["tasks"]:
                labels = [d, t["task"]]
                _task(g, labels, t)
        yield from g.values()
        yield from moonraker.values()
        yield refused


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
    put("accuracy" if field.get("metric") == "accuracy" else "error", field.get("value"))
    put("reference", field.get("reference"))
    if isinstance(field.get("drift"), bool):
        put("drift", float(field["drift"]))
    put("awaiting", field.get("awaiting_labels"))
    put("coverage", field.get("coverage_value"))
    put("answered", t["answered"])
    for reason, n in sorted(t["refused"].items()):
        put("refused", n, reason)
    put("round", t["model"].get("round"))
    ev = t.get("evidence") or {}
    serving = t["model"].get("candidate")
    for name, score in sorted((ev.get("scores") or {}).items()):
        put("candidate", float(name == serving), name)
        put("score", score, name)
    put("judged", ev.get("rows"))

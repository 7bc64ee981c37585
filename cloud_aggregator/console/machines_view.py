"""The console's machines view: per device its condition now, recent answers, alerts, field accuracy
and serving model, joined from its retained status (``serving``, ``alerts``) and the answers and
alert events :class:`cloud_aggregator.console.machines_feed.MachineLog` keeps.

Shaped once per change for the page (``machines`` in the view the page receives) and read by
the metrics (:mod:`cloud_aggregator.console.machines_metrics`).  Every field taken from a status is
type-checked here, as :mod:`cloud_aggregator.console.fleet_view` does.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from cloud_aggregator.console.feed import ViewSource
from cloud_aggregator.console.fleet_status import number
from cloud_aggregator.console.fleet_view import FleetView
from cloud_aggregator.console.machines_feed import (
    MAX_RULES,
    MAX_TEXT,
    MachineLog,
    Point,
    merged_alerts,
    words,
)

#: The fields of a status's ``serving.models.<task>`` shown as the serving model.
MODEL_FIELDS = (
    "round",
    "digest",
    "metric",
    "metric_name",
    "encoder",
    "encoder_version",
    "since",
    "candidate",
    "reference",  # None: no test figure, so drift is never told
)
#: The counts of ``serving.moonraker`` (the speed advice applied to a printer through Moonraker).
MOONRAKER_COUNTS = ("sent", "failed", "restored", "readback_mismatch", "dropped")
#: A device's candidate models (``edge.serving.candidates``), in the order the page lists them.
CANDIDATES = ("personal", "global", "alone")
#: The fields of ``serving.field.<task>``.
FIELD_FIELDS = ("metric", "value", "n", "scored", "reference", "drift", "awaiting_labels")
#: ``serving.field.<task>.coverage`` (edge.serving.conformal), shown as ``coverage_<name>``.
COVERAGE_FIELDS = ("level", "value", "n")


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _plain(value: Any) -> Any:
    """A number, a short string or a bool from a device (anything else: ``None``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value[:MAX_TEXT]
    return number(value)


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _counts(value: Any) -> dict[str, float]:
    return {str(k)[:MAX_TEXT]: n for k, v in _dict(value).items() if (n := number(v)) is not None}


def field_json(field: dict) -> dict[str, Any]:
    """A task's field figures, its interval coverage flattened in (``coverage_value``, ...)."""
    coverage = _dict(field.get("coverage"))
    return {k: _plain(field.get(k)) for k in FIELD_FIELDS} | {
        f"coverage_{k}": _plain(coverage.get(k)) for k in COVERAGE_FIELDS
    }


def _moonraker(value: Any) -> dict[str, Any] | None:
    """The advice's Moonraker counts and whether applying is refused (``None``: it applies nothing)."""
    if not isinstance(value, dict):
        return None
    out: dict[str, Any] = {k: number(value.get(k)) for k in MOONRAKER_COUNTS}
    out["refused"] = str(value["refused"])[:300] if isinstance(value.get("refused"), str) else None
    out["last_error"] = str(value["last_error"])[:300] if isinstance(value.get("last_error"), str) else None
    out["dry_run"] = value.get("dry_run") is True
    return out


def rules(value: Any) -> list[dict[str, Any]]:
    """The device's alert rules (``serving.rules``): each with its words and why it cannot fire, if so."""
    out = []
    for name, rule in list(_dict(value).items())[:MAX_RULES]:
        r = _dict(rule)
        out.append({"rule": str(name)[:MAX_TEXT], "task": _plain(r.get("task")), "value": _plain(r.get("value")),
                    "above": number(r.get("above")), "action": words(r.get("action")),
                    "meaning": words(r.get("meaning")), "silent": str(r["silent"])[:300]
                    if isinstance(r.get("silent"), str) else None})  # fmt: skip
    return sorted(out, key=lambda r: r["rule"])


def evidence(value: Any) -> dict[str, Any] | None:
    """Why the serving candidate serves (``edge.serving.candidates``): rows judged, each candidate's score."""
    body = _dict(value)
    if not body:
        return None
    got = list(_dict(body.get("scores")).items())[:MAX_RULES]
    got.sort(key=lambda kv: (CANDIDATES.index(kv[0]) if kv[0] in CANDIDATES else len(CANDIDATES), str(kv[0])))
    scores = {str(k)[:MAX_TEXT]: number(v) for k, v in got}
    return {
        "rows": number(body.get("rows")),
        "metric": _plain(body.get("metric")),
        "why": str(body["why"])[:300] if isinstance(body.get("why"), str) else None,
        # Where alone wins: the copy on every row serves, judged by its twin on the older rows.
        "serves": str(body["serves"])[:300] if isinstance(body.get("serves"), str) else None,
        "scores": scores,
    }


def timeline(points: list[Point]) -> dict[str, Any]:
    """One task's recent answers as the page plots them: ``[row_time, key, values...]`` each, oldest
    first; a layer's values are (expected speed, commanded speed), a weld's one probability per class."""
    classes = next((p.classes for p in reversed(points) if p.classes is not None), None)
    rows: list[list[Any]] = []
    for p in points:
        if classes is not None:
            if p.classes != classes:  # another model's classes: not on this chart
                continue
            rows.append([p.row_time, p.key, *(p.probabilities or ())])
        else:
            rows.append([p.row_time, p.key, p.expected_speed, p.commanded])
    return {"classes": list(classes) if classes is not None else None, "points": rows}


def _task_json(task: str, serving: dict, answers: list[Point], last: Point | None) -> dict[str, Any]:
    """One task of a machine: its model (named by ``last``, its newest answer, before any status),
    the evidence, the answers' timeline, the field, the advice and the counts."""
    models, fields, advice = (
        _dict(serving.get("models")),
        _dict(serving.get("field")),
        _dict(serving.get("advice")),
    )
    refused, gate, answered = (
        _dict(serving.get("refused")),
        _dict(serving.get("gate")),
        _dict(serving.get("answered")),
    )
    model = {k: _plain(_dict(models.get(task)).get(k)) for k in MODEL_FIELDS}
    if model["round"] is None and last is not None:  # no status yet: the answer names its model
        model |= {"round": last.model_round, "digest": last.digest, "encoder_version": last.encoder_version}
    return {
        "task": str(task)[:MAX_TEXT],
        "model": model,
        "evidence": evidence(_dict(models.get(task)).get("evidence")),
        "latest": last.to_json() if last is not None else None,
        "timeline": timeline([p for p in answers if p.task == task]),
        "field": field_json(_dict(fields.get(task))) if task in fields else None,
        "advice": _first(number(_dict(advice.get(task)).get("speed")), last.advice if last else None),
        "vibration_budget": number(_dict(advice.get(task)).get("vibration_budget")),
        "answered": number(answered.get(task)),
        "refused": _counts(refused.get(task)),
        "gate": str(gate[task])[:300] if isinstance(gate.get(task), str) else None,
    }


def _classes(value: Any) -> dict[str, Any]:
    """What each class means, in the operator's words ([serve.classes]); at most ``MAX_RULES``."""
    return {
        str(k)[:MAX_TEXT]: w for k, v in list(_dict(value).items())[:MAX_RULES] if (w := words(v)) is not None
    }


def machine_json(
    device: str, status: Any, answers: list[Point], latest: dict[str, Point], events: dict[str, dict]
) -> dict[str, Any]:
    """One machine for the page and the metrics (see the module docstring)."""
    body = _dict(status)
    serving = _dict(body.get("serving"))
    models, fields, refused = (
        _dict(serving.get("models")),
        _dict(serving.get("field")),
        _dict(serving.get("refused")),
    )
    names = sorted({*latest, *models, *fields, *(t for t in refused if t != "*")}, key=str)[:MAX_RULES]
    tasks = [_task_json(task, serving, answers, latest.get(task)) for task in names]
    alerts = merged_alerts(events, body.get("alerts"))
    kind = body.get("kind")
    # Seen: its newest word, a status or an answer (a machine answering every second is not 23 s old).
    heard = [
        t for t in (number(body.get("time")), *(p.answered_at for p in latest.values())) if t is not None
    ]
    return {
        "device": device[:MAX_TEXT],
        "online": body.get("state") == "online",
        "last_seen": max(heard) if heard else None,
        "kind": kind[:20] if isinstance(kind, str) else None,
        "serving": serving.get("enabled") if isinstance(serving.get("enabled"), bool) else None,
        "refused_rows": _counts(refused.get("*")),
        "last_latency_s": number(serving.get("last_latency_s")),
        "moonraker": _moonraker(serving.get("moonraker")),
        "counting_since": number(serving.get("counting_since")),  # the counts' _created
        "tasks": tasks,
        "alerts": alerts,
        "open_alerts": sum(a["state"] == "raised" for a in alerts),
        "rules": rules(serving.get("rules")),
        "classes": _classes(serving.get("classes")),
    }


def machines_json(
    statuses: dict[str, Any], machine_log: MachineLog | None, revoked: Collection[str] = ()
) -> list[dict[str, Any]]:
    """Every machine that wrote a status or an answer, by name (revoked devices left out)."""
    answers, latest, events = machine_log.snapshot() if machine_log is not None else ({}, {}, {})
    devices = sorted({*statuses, *latest, *events} - set(revoked))
    return [
        machine_json(d, statuses.get(d), answers.get(d, []), latest.get(d, {}), events.get(d, {}))
        for d in devices
    ]


def _machines(source: ViewSource, view: FleetView) -> list[dict[str, Any]]:
    return machines_json(
        view.statuses, source.feed.machines if source.feed is not None else None, view.revoked
    )


def machines_of(source: ViewSource) -> list[dict[str, Any]]:
    """The machines as ``source`` sees them now (the metrics' input)."""
    return _machines(source, source.view())


def view_json(source: ViewSource) -> dict[str, Any]:
    """What both pages receive: the fleet's view (:meth:`FleetView.to_json`) and its ``machines``."""
    view = source.view()
    return {**view.to_json(), "machines": _machines(source, view)}

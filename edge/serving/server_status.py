"""What the serving part of the trainer's retained status says (``serving``): counts, models, facts.

Read by :meth:`edge.serving.server.Server.status`; the console, ``fleet status`` and Home
Assistant read it in turn.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Protocol

from edge.config_serve import ServeConfig
from edge.serving.advising import Advising
from edge.serving.alerts import Alerts, rule_problem
from edge.serving.feed_reader import FeedReader
from edge.serving.field import FieldScores
from edge.serving.model import ServingModel


class Server(Protocol):
    """What the status reads of :class:`edge.serving.server.Server` (which imports this module)."""

    cfg: ServeConfig
    enabled: bool
    models: dict[str, ServingModel]
    rows: int
    answered: Counter[str]
    refused: dict[str, Counter[str]]
    counting_since: float
    gate: dict[str, str]
    unchecked: str | None
    publish_errors: int
    last_latency_s: float | None
    watch_lock: threading.Lock
    field: FieldScores
    alerts: Alerts
    advising: Advising
    feed: FeedReader

    def serves(self, task: str) -> bool: ...

    def say(self, task: str, what: str, message: str) -> None: ...


def model_facts(m: ServingModel) -> dict[str, Any]:
    """One serving model in the status."""
    return {
        "round": m.round,
        "digest": m.digest,
        "metric": m.metric,
        "metric_name": m.metric_name,
        "encoder": m.encoder,
        "encoder_version": m.encoder_version,
        "since": m.created_at,
        "calibration_rows": len(m.calibration),
        "candidate": m.candidate,
        "every_row": m.every_row,  # the alone copy on every row, judged by its twin on the older ones
        "evidence": m.evidence,
        "reference": m.reference,  # None: no test figure, so no drift is ever told
    }


def rule_status(srv: Server) -> dict[str, dict[str, Any]]:
    """Each alert rule, its words, and why it cannot fire (yet), if so: the status's ``rules``."""
    out = {}
    for rule in srv.cfg.alerts if srv.enabled else []:
        model = srv.models.get(rule.task)
        if not srv.serves(rule.task):
            silent = f"task {rule.task} does not serve here ([serve] tasks)"
        elif model is None:
            silent = f"task {rule.task} has no serving model yet"
        else:
            silent = rule_problem(rule, model.classes)
            if silent is not None:
                srv.say(rule.task, f"rule {rule.name}", f"alert rule never fires: {silent}")
        action, meaning = srv.alerts.words(rule)
        out[rule.name] = {"task": rule.task, "value": rule.value, "above": rule.above,
                          "action": action, "meaning": meaning, "silent": silent}  # fmt: skip
    return out


def status(srv: Server) -> dict[str, Any]:
    """The serving part of the trainer's retained status."""
    if not srv.enabled:
        return {"enabled": False}
    with srv.watch_lock:
        field = srv.field.status({t: m.reference for t, m in list(srv.models.items())})
        alerts, unknown = srv.alerts.status(), srv.field.unknown_labels
    advising = srv.advising
    return {
        "enabled": True,
        "rows": srv.rows,
        "answered": dict(srv.answered),
        "refused": {t: dict(c) for t, c in srv.refused.items()},
        "counting_since": srv.counting_since,
        "models": {t: model_facts(m) for t, m in list(srv.models.items())},
        "gate": dict(srv.gate),
        "field": field,
        "unknown_labels": unknown,
        "advice": advising.status(),
        **({"moonraker": advising.moonraker_status()} if advising.moonraker is not None else {}),
        "alerts": alerts,
        "alerts_untrusted": srv.alerts.untrusted,
        "rules": rule_status(srv),
        **({"rules_unchecked": srv.unchecked} if srv.unchecked else {}),
        "classes": dict(srv.cfg.classes),
        "publish_errors": srv.publish_errors,
        "skipped_lines": srv.feed.skipped,
        "last_latency_s": srv.last_latency_s,
    }

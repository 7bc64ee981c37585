"""The body of a device's retained status (``ioft/<fleet>/status/<device>``): its rounds, models,
refusals, holdout scores, pause, the aggregator it has not heard, serving, data and process cost.

Built from what the daemon holds (:class:`StatusSource`, which :class:`edge.daemon.EdgeTrainer`
is) so the daemon only decides when to publish it.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any, Protocol

from edge.config import DeviceConfig
from edge.feed import STATUS_FILE as RECORDER_STATUS
from edge.models.manager import ModelManager
from edge.optout import PauseWatch
from edge.serving.server import Server
from edge.task_state import TaskState
from ioft_protocol import restate, round_messages
from trainer_lite.data import Dataset


class LinkFacts(Protocol):
    """What the status reports of the device's link (:class:`edge.device_link.DeviceLink`)."""

    connected_at: float | None
    unheard: str | None


class StatusSource(Protocol):
    """What the status reports, as the daemon holds it."""

    config: DeviceConfig
    device: str
    state_dir: Path
    tasks: dict[str, TaskState]
    models: ModelManager | None
    refused: dict[str, str]
    holdout: dict[str, round_messages.HoldoutScore]
    pause: PauseWatch
    ahead: dict[str, dict[str, object]]
    serving: Server
    train: Dataset
    test: Dataset
    data_meta: dict
    round_cpu_s: float | None


def fleet_scaling_status(d: Any) -> dict[str, dict[str, Any]]:
    """Per ``scaling = "fleet"`` task: the pooled transform applied (from which devices, how many
    rows), or ``waiting`` once this device sent its statistics and none has come yet."""
    inputs, stats = getattr(d, "inputs", None), getattr(d, "fleet_stats", None)
    sent = {} if stats is None else stats.sent
    applied = {} if inputs is None else inputs.fleet
    out: dict[str, dict[str, Any]] = {
        task: {"state": "applied", "devices": list(p.devices), "rows": p.rows} for task, p in applied.items()
    }
    for task in sent:
        out.setdefault(task, {"state": "waiting for the pooled transform (statistics sent)"})
    return out


def status_body(d: StatusSource, state: str, link: LinkFacts) -> dict[str, Any]:
    """The status of ``d`` as ``state`` (``"online"``, or ``"offline"`` for the Last Will)."""
    body: dict[str, Any] = {
        "device": d.device,
        "state": state,
        "time": time.time(),
        "kind": d.config.machine_kind,
        "tags": list(d.config.tags),
        restate.CONNECTED_AT: link.connected_at,
        "tasks": {
            name: {"round": ts.answered[0] if ts.answered else None, "metrics": ts.metrics}
            for name, ts in d.tasks.items()
        },
    }
    if d.models is not None:
        body["models"] = d.models.status()
    if d.refused:
        body["refused"] = dict(d.refused)
    if d.holdout:
        body["holdout"] = {task: score.to_json() for task, score in d.holdout.items()}
    if d.pause.reason is not None:
        body["paused"] = d.pause.reason
    if d.ahead:  # task -> {task, device_round, announced_round}: the aggregator's store is behind
        body["ahead_of_aggregator"] = dict(d.ahead)
    if link.unheard is not None:
        body["aggregator"] = link.unheard
    scaling = fleet_scaling_status(d)
    if scaling:  # tasks with scaling = "fleet": the transform applied, or that it is awaited
        body["fleet_scaling"] = scaling
    session = getattr(d, "session", None)  # the Last Will is built before the session
    if session is not None and session.takeovers:  # another client holds our identity (stolen?)
        body["takeovers"] = {"count": session.takeovers, "last": session.last_takeover}
    if d.serving.enabled:
        body["serving"] = d.serving.status()
        body["alerts"] = body["serving"]["alerts"]  # open alerts, for the console and Home Assistant
    body["data"] = data_status(d.train, d.test, d.data_meta, d.state_dir)
    body["process"] = {  # for the console and its metrics: what a round costs this device
        "cpu_s_round": d.round_cpu_s,
        "cpu_s_total": time.process_time(),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }
    return body


def data_status(train: Dataset, test: Dataset, meta: dict, state_dir: Path) -> dict:
    """Rows on hand and, where edge-recorder runs beside this daemon, the state of its sensors."""
    out: dict = {"train": len(train), "test": len(test), "source": meta.get("source"),
                 # push offers a model only to devices whose data follow its feature schema
                 "schema": meta.get("schema_hash")}  # fmt: skip
    try:
        rec = json.loads((state_dir / RECORDER_STATUS).read_text())
    except (OSError, ValueError, RecursionError):
        return out  # no recorder here (simulated data), or a status being replaced: skip it
    if isinstance(rec, dict):
        out["sensor"] = {k: rec.get(k) for k in ("state", "running", "updated_at", "appended", "schema")}
    return out

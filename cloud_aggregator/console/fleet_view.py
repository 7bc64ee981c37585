"""The fleet as the console and its metrics see it: the aggregator's store plus the devices' statuses.

:func:`read_store` reads the store read-only (never a write lock, so the round loop is
never held up); :class:`FleetView` joins it with the retained statuses, and
:meth:`FleetView.to_json` shapes what the browser draws.  Statuses are written by the
devices themselves, so every field taken from one is type-checked here, the way
``fleet status`` checks them (:func:`cloud_aggregator.console.fleet_status.summarize`).
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloud_aggregator.console.fleet_status import METRICS, number, summarize
from cloud_aggregator.rounds.types import Reason, RoundRecord
from cloud_aggregator.store.sqlite import SqliteStore

#: Round rows per task sent to the page (the curves hold every round).
RECENT_ROUNDS = 12
#: Rows per rollout table sent to the page.
RECENT_ROLLOUTS = 50


@dataclass
class StoreData:
    """What the store holds, read in one go."""

    specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    rounds: dict[str, list[RoundRecord]] = field(default_factory=dict)
    #: ``{task: {device: {reason code: refusals}}}``
    refused: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    #: ``{table: (columns, rows)}`` for each table whose name starts with ``rollout``
    rollouts: dict[str, tuple[list[str], list[tuple]]] = field(default_factory=dict)


def store_signature(path: Path) -> tuple:
    """Changes whenever the aggregator commits (the database and its WAL's size and time)."""
    out: list[int] = []
    for p in (path, path.with_name(path.name + "-wal")):
        try:
            st = p.stat()
            out += [st.st_mtime_ns, st.st_size]
        except OSError:
            out += [0, 0]
    return tuple(out)


def read_store(path: Path) -> StoreData:
    """Everything the console shows from ``aggregator.sqlite``; empty before the aggregator made it."""
    data = StoreData()
    if not path.exists():
        return data
    store = SqliteStore(path, readonly=True)
    try:
        for name, spec in store.tasks().items():
            data.specs[name] = json.loads(spec)
            data.rounds[name] = store.rounds(name)
            data.refused[name] = store.rejection_counts_by_reason(name)
    except sqlite3.OperationalError:
        return StoreData()  # the aggregator has not created its tables yet
    finally:
        store.close()
    data.rollouts = _rollout_tables(path)
    return data


def _rollout_tables(path: Path) -> dict[str, tuple[list[str], list[tuple]]]:
    """Tables named ``rollout*`` (staged rollouts keep their state there), newest rows last."""
    out: dict[str, tuple[list[str], list[tuple]]] = {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        names = [
            r[0]
            for r in db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name LIKE 'rollout%'")
        ]
        for name in names:
            cur = db.execute(
                f'SELECT * FROM "{name}" ORDER BY rowid DESC LIMIT ?',  # name from sqlite_master
                (RECENT_ROLLOUTS,),
            )
            out[name] = ([d[0] for d in cur.description], cur.fetchall()[::-1])
    except sqlite3.OperationalError:
        return {}
    finally:
        db.close()
    return out


def _texts(value: Any, limit: int = 120) -> dict[str, str]:
    """A ``{str: str}`` map from a device, cut short; other entries dropped."""
    if not isinstance(value, dict):
        return {}
    return {str(k)[:60]: str(v)[:limit] for k, v in value.items() if isinstance(v, str)}


def _sub(body: dict, key: str) -> dict:
    value = body.get(key)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class DeviceFigures:
    """One device's figures, type-checked out of its retained status."""

    device: str
    online: bool
    last_seen: float | None
    kind: str | None
    rows: dict[str, float]
    sensor: str | None
    models: dict[str, float]
    refused_tasks: dict[str, str]
    cpu_s_round: float | None
    max_rss_bytes: float | None
    #: The owner's note when they paused the device (``edge-trainer pause``); ``None``: taking part.
    paused: str | None = None

    @classmethod
    def of(cls, device: str, body: Any) -> DeviceFigures:
        body = body if isinstance(body, dict) else {}
        data, process = _sub(body, "data"), _sub(body, "process")
        rows = {k: v for k in ("train", "test") if (v := number(data.get(k))) is not None}
        sensor = data.get("sensor")
        state = sensor.get("state") if isinstance(sensor, dict) else None
        models = {}
        for name, m in _sub(body, "models").items():
            active = number(m.get("active")) if isinstance(m, dict) else None
            if active is not None:
                models[str(name)[:60]] = active
        kind = body.get("kind")
        return cls(
            device=device[:60],
            online=body.get("state") == "online",
            last_seen=number(body.get("time")),
            kind=kind[:20] if isinstance(kind, str) else None,
            rows=rows,
            sensor=state[:12] if isinstance(state, str) else None,
            models=models,
            refused_tasks=_texts(body.get("refused")),
            cpu_s_round=number(process.get("cpu_s_round")),
            max_rss_bytes=number(process.get("max_rss_bytes")),
            paused=str(body["paused"])[:120] if isinstance(body.get("paused"), str) else None,
        )


def preferred_metric(records: list[RoundRecord]) -> str | None:
    """The metric a task's curves plot: the first of ``fleet_status.METRICS`` any device reported."""
    seen = {k for rec in records for m in rec.metrics.values() for k in m}
    return next((k for k in METRICS if k in seen), None)


@dataclass
class FleetView:
    """The store's contents and the devices' statuses at one moment."""

    fleet: str
    store: StoreData
    statuses: dict[str, Any]
    #: Broker-wide counters from ``$SYS`` (``bytes_received``, ``bytes_sent``), where the broker has them.
    broker: dict[str, float] = field(default_factory=dict)
    taken: float = field(default_factory=time.time)
    #: Devices revoked from the fleet (``fleet revoke-device``): shown as such, not as offline.
    revoked: set[str] = field(default_factory=set)

    def devices(self) -> list[DeviceFigures]:
        return [DeviceFigures.of(d, self.statuses[d]) for d in sorted(self.statuses)]

    def refused_by_device(self) -> dict[str, dict[str, int]]:
        """``{device: {reason: refusals}}`` over all tasks (``resent`` copies included)."""
        out: dict[str, dict[str, int]] = {}
        for per_task in self.store.refused.values():
            for device, reasons in per_task.items():
                mine = out.setdefault(device, {})
                for reason, n in reasons.items():
                    mine[reason] = mine.get(reason, 0) + n
        return out

    def to_json(self) -> dict[str, Any]:
        """What the page draws: devices, tasks with curves and recent rounds, model versions, rollouts."""
        return {
            "fleet": self.fleet,
            "taken": self.taken,
            "devices": self._devices_json(),
            "tasks": [self._task_json(name) for name in sorted(self.store.specs)],
            "versions": self._versions(),
            "rollouts": {
                name: {"columns": cols, "rows": [[_cell(v) for v in row] for row in rows]}
                for name, (cols, rows) in self.store.rollouts.items()
            },
            "broker": self.broker,
        }

    def _devices_json(self) -> list[dict[str, Any]]:
        """Each device's row: its status, its refused and resent uploads; then the devices refused but
        never reported."""
        refused = self.refused_by_device()
        # Copies of counted uploads are routine: shown apart from the refusals, never as one.
        resent = {d: n for d, per in refused.items() if (n := per.pop(Reason.RESENT, 0))}
        refused = {d: per for d, per in refused.items() if per}
        # The tasks a device refuses have a column of their own: not again among its tasks.
        cells = {r["device"]: r for r in summarize(self.statuses, self.revoked, refusals_in_tasks=False)}
        devices = []
        for f in self.devices():
            row = cells.get(f.device, {})
            devices.append(
                {
                    "device": f.device,
                    "online": f.online and f.device not in self.revoked,
                    "revoked": f.device in self.revoked,
                    "paused": f.paused,
                    "last_seen": f.last_seen,
                    "kind": row.get("kind", "-"),
                    "rows": f.rows,
                    "sensor": f.sensor,
                    "models": row.get("models", "-"),
                    "tasks": row.get("tasks", "-"),
                    "refused_tasks": f.refused_tasks,
                    "uploads_refused": refused.get(f.device, {}),
                    "uploads_resent": resent.get(f.device, 0),
                    "cpu_s_round": f.cpu_s_round,
                    "max_rss_bytes": f.max_rss_bytes,
                }
            )
        for device in sorted({*refused, *resent} - {d["device"] for d in devices}):  # refused, never reported
            devices.append(
                {
                    "device": device,
                    "online": False,
                    "uploads_refused": refused.get(device, {}),
                    "uploads_resent": resent.get(device, 0),
                }
            )
        return devices

    def _task_json(self, name: str) -> dict[str, Any]:
        spec = self.store.specs[name]
        records = self.store.rounds.get(name, [])
        metric = preferred_metric(records)
        curves: dict[str, dict[int, float]] = {}
        mean: dict[int, float] = {}
        for rec in records:  # a later phase of the same round overwrites an earlier one
            if metric is None:
                break
            for device, m in rec.metrics.items():
                if (v := number(m.get(metric))) is not None:
                    curves.setdefault(device, {})[rec.round] = v
            if (v := number(rec.mean_metric(metric))) is not None:
                mean[rec.round] = v
        return {
            "name": name,
            "algorithm": spec.get("algorithm"),
            "model": spec.get("model"),
            "planned": spec.get("rounds"),
            "metric": metric,
            "completed": sum(r.status == "completed" for r in records),
            "abandoned": sum(r.status == "abandoned" for r in records),
            "last_finished": max((r.finished for r in records), default=None),
            "curves": {d: sorted(c.items()) for d, c in sorted(curves.items())},
            "mean": sorted(mean.items()),
            "rounds": [_round_json(r, metric) for r in records[-RECENT_ROUNDS:]],
        }

    def _versions(self) -> dict[str, dict[str, int]]:
        """``{model: {active version: devices}}``: where a push has got to."""
        out: dict[str, dict[str, int]] = {}
        for f in self.devices():
            for model, version in f.models.items():
                per = out.setdefault(model, {})
                per[f"v{version:g}"] = per.get(f"v{version:g}", 0) + 1
        return out


def _round_json(rec: RoundRecord, metric: str | None) -> dict[str, Any]:
    closed = rec.extra.get("closed")
    return {
        "round": rec.round,
        "phase": rec.phase,
        "status": rec.status,
        "participants": sorted(rec.participants),
        "duration_s": rec.finished - rec.started,
        "closed": closed if isinstance(closed, str) else None,
        "sat_out": rec.extra.get("refused") or {},
        "rejected": rec.rejected,
        "late": rec.extra.get("late") or [],
        "mean": number(rec.mean_metric(metric)) if metric else None,
        "holdout": _holdout(rec.extra.get("holdout"), metric),
    }


def _holdout(scores: Any, metric: str | None) -> dict[str, Any]:
    """Held-out devices' scores of the round's global, by the metric the task's curve plots."""
    if not isinstance(scores, dict) or not metric:
        return {}
    key = metric.removeprefix("test_")
    return {d: number(s.get(key)) for d, s in scores.items() if isinstance(s, dict) and key in s}


def _cell(value: Any) -> Any:
    """A rollout table cell as JSON: a JSON record summarised, text cut short, blobs by size."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        try:
            record = json.loads(value) if value.startswith("{") else None
        except (ValueError, RecursionError):
            record = None
        return _summary(record)[:400] if isinstance(record, dict) else value[:200]
    return value


def _summary(record: dict[str, Any]) -> str:
    """``key=value; ...`` of a record's short fields (long ones, such as a signed offer, left out)."""
    parts = []
    for key, value in record.items():
        if isinstance(value, dict):
            inner = ", ".join(
                f"{k} {' '.join(str(x) for x in v.values() if x not in (None, '')) if isinstance(v, dict) else v}"
                for k, v in value.items()
            )
            text = f"{key}: {inner}" if inner else ""
        elif isinstance(value, list):
            text = f"{key}=" + ",".join(str(v) for v in value)
        else:
            text = "" if value in (None, "") else f"{key}={value}"
        if text and len(text) <= 120:
            parts.append(text)
    return "; ".join(parts)

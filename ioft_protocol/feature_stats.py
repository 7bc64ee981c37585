"""Fleet scaling (a task's ``scaling = "fleet"``): the two messages it takes.

Each device of the task sends its feature statistics once, ``(n, Σx, Σx²)`` over its training
rows (:class:`FeatureStats`, QoS 1 on ``task/<task>/stats/<device>``); the aggregator pools them
once it holds at least the task's minimum number of devices and publishes the pooled per-feature
mean and deviation (:class:`FleetScaling`, retained on ``task/<task>/scaling``).  Every device
applies that one transform to the rows it trains on and the rows it answers.  Neither message
carries a row.  The pooling itself is ``sensors.features.scaling.pool_feature_sums``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ioft_protocol.codec import WireError, check_id
from trainer_lite.algorithms.base import MIN_POOL_DEVICES

__all__ = ["MIN_POOL_DEVICES", "MIN_STATS_ROWS", "FeatureStats", "FleetScaling"]

#: A device sends statistics of at least this many training rows (fewer would show the
#: aggregator its rows all but exactly: two rows are their mean ± deviation).
MIN_STATS_ROWS = 10


def _floats(meta: dict[str, Any], key: str, width: int | None = None) -> np.ndarray:
    value = meta.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, int | float) for v in value):
        raise WireError(f"field {key!r} must be a non-empty list of numbers")
    out = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        raise WireError(f"field {key!r} holds a non-finite number")
    if width is not None and len(out) != width:
        raise WireError(f"field {key!r} has {len(out)} entries, expected {width}")
    return out


def _object(payload: bytes, what: str) -> dict[str, Any]:
    try:
        meta = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"{what} is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError(f"{what} must be a JSON object")
    return meta


def _count(meta: dict[str, Any], key: str, least: int) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise WireError(f"field {key!r} must be an integer >= {least}, got {value!r}")
    return value


@dataclass(frozen=True)
class FeatureStats:
    """One device's ``n``, ``Σx`` and ``Σx²`` over its training rows for one task (float64)."""

    task: str
    device: str
    n: int
    sum: np.ndarray
    sumsq: np.ndarray

    def encode(self) -> bytes:
        # JSON floats round-trip float64 exactly (repr), so the pooled transform is the same bits
        # the study computes in process.
        body = {"task": self.task, "device": self.device, "n": self.n,
                "sum": [float(v) for v in self.sum], "sumsq": [float(v) for v in self.sumsq]}  # fmt: skip
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, payload: bytes) -> FeatureStats:
        """Raises :class:`WireError` naming the bad field (fewer than :data:`MIN_STATS_ROWS` rows included)."""
        meta = _object(payload, "feature statistics")
        task, device = meta.get("task"), meta.get("device")
        if not isinstance(task, str) or not isinstance(device, str):
            raise WireError("feature statistics need string fields 'task' and 'device'")
        n = _count(meta, "n", MIN_STATS_ROWS)
        total = _floats(meta, "sum")
        sumsq = _floats(meta, "sumsq", len(total))
        if np.any(sumsq < 0):
            raise WireError("field 'sumsq' holds a negative sum of squares")
        return cls(check_id("task", task), check_id("device", device), n, total, sumsq)


@dataclass(frozen=True)
class FleetScaling:
    """The pooled transform of a task: ``(x − mean) / std`` per feature, from ``devices``' statistics."""

    task: str
    devices: tuple[str, ...]
    rows: int
    mean: np.ndarray
    std: np.ndarray

    def encode(self) -> bytes:
        body = {"task": self.task, "devices": sorted(self.devices), "rows": self.rows,
                "mean": [float(v) for v in self.mean], "std": [float(v) for v in self.std]}  # fmt: skip
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, payload: bytes) -> FleetScaling:
        meta = _object(payload, "fleet scaling")
        task, devices = meta.get("task"), meta.get("devices")
        if not isinstance(task, str):
            raise WireError("fleet scaling needs a string field 'task'")
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
            raise WireError("fleet scaling needs a list of device ids 'devices'")
        if len(set(devices)) < MIN_POOL_DEVICES:
            raise WireError(
                f"fleet scaling pooled from {len(set(devices))} devices; at least {MIN_POOL_DEVICES} are needed"
            )
        mean = _floats(meta, "mean")
        std = _floats(meta, "std", len(mean))
        if np.any(std <= 0) or not all(math.isfinite(v) for v in std):
            raise WireError("field 'std' must hold positive numbers")
        return cls(
            check_id("task", task),
            tuple(check_id("device", d) for d in devices),
            _count(meta, "rows", 1),
            mean,
            std,
        )

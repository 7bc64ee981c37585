"""What a fleet trains: a task spec that the aggregator announces and devices obey."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trainer_lite.privacy import DPConfig


@dataclass(frozen=True)
class TaskSpec:
    """A federated task: algorithm, model and hyperparameters, as plain JSON-able values.

    Parameters
    ----------
    name
        Topic-safe task id (``[a-z0-9_-]+``), e.g. ``"speed"``.
    algorithm
        Registered algorithm name (``trainer_lite.algorithms``), e.g. ``"pflda"``.
    model
        Registered model name (``trainer_lite.models``), e.g. ``"sigmoid_glm"``.
    model_args
        Keyword arguments of the model builder.
    hparams
        Client hyperparameters (the algorithm's config dataclass validates them).
    server
        Server hyperparameters (the strategy's config validates them), e.g.
        ``{"weighting": "uniform"}``.
    dtype
        Floating dtype of parameters and data on the device and on the wire.
    rounds
        Number of communication rounds.
    seed
        Seed of the global initialization; devices derive theirs from it and their id.
    feature_schema
        SHA-256 hex of the schema of the input rows the model is built for (the
        ``schema_hash`` a device's dataset meta carries: ``sensors.features``'
        ``FeatureSchema`` for weld features, ``sensors.sim.vibration.WindowSchema``
        for raw windows).  A device whose local data carries another hash, or none,
        refuses the task (``edge.daemon``).  ``None``: no check -- and the field is left
        out of :meth:`to_json`, so a spec without it reads the same to a device that knows no such field.
    dp
        Differential privacy (``trainer_lite.privacy.DPConfig.to_spec()``): devices clip
        their shared change and, in distributed mode, add their noise share.  ``None``: off,
        and left out of :meth:`to_json` like ``feature_schema``.
    secagg
        Secure aggregation (``ioft_protocol.secagg.SecAggConfig.to_json()``: threshold, degree,
        clip, bits, max_weight): devices upload their masked change and the aggregator learns
        only the survivors' sum.  ``None``: off, and left out of :meth:`to_json`.
    compress
        Compressed uplinks (``ioft_protocol.compress.CompressConfig.to_json()``: bits, rotation,
        block): devices upload their change quantized.  ``None``: off, and left out of :meth:`to_json`.
    """

    name: str
    algorithm: str
    model: str
    model_args: dict[str, Any] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    rounds: int = 10
    seed: int = 0
    feature_schema: str | None = None
    dp: dict[str, Any] | None = None
    secagg: dict[str, Any] | None = None
    compress: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (
            not self.name
            or not all(c.isalnum() or c in "_-" for c in self.name)
            or self.name != self.name.lower()
        ):
            raise ValueError(f"task name must match [a-z0-9_-]+, got {self.name!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.feature_schema is not None and not (
            isinstance(self.feature_schema, str) and re.fullmatch(r"[0-9a-f]{64}", self.feature_schema)
        ):
            raise ValueError(f"feature_schema must be a sha256 hex digest, got {self.feature_schema!r}")
        DPConfig.from_spec(self.dp)  # refuses a bad dp table by field
        if self.secagg is not None and not isinstance(self.secagg, dict):
            raise ValueError(f"secagg must be a table of settings, got {self.secagg!r}")
        if self.compress is not None and not isinstance(self.compress, dict):
            raise ValueError(f"compress must be a table of settings, got {self.compress!r}")

    def to_json(self) -> str:
        body = asdict(self)
        if self.feature_schema is None:
            del body["feature_schema"]  # specs without one keep their old form (and stored state)
        if self.dp is None:
            del body["dp"]
        if self.secagg is None:
            del body["secagg"]
        if self.compress is None:
            del body["compress"]
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TaskSpec:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("task spec must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown task spec fields {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**raw)


#: Spec fields that schedule a task rather than define what it trains: an operator may change
#: them and keep the task's history on the aggregator and its local state on every device.
SCHEDULE_FIELDS = frozenset({"rounds"})


def training_changes(old_json: str, new_json: str) -> list[str]:
    """Sorted names of the fields two ``TaskSpec.to_json()`` texts differ in, ``SCHEDULE_FIELDS`` aside."""
    if old_json == new_json:  # the usual case, each round: no need to parse both
        return []
    old, new = json.loads(old_json), json.loads(new_json)
    return sorted(k for k in set(old) | set(new) if k not in SCHEDULE_FIELDS and old.get(k) != new.get(k))

"""The wire: topic names and payload encoding, owned here and imported by both sides.

Payloads are safetensors bytes (a JSON header, then raw little-endian tensors; no
pickle, nothing executable) whose ``__metadata__`` holds one key, ``ioft``: a JSON
object with the protocol version, the message kind and its fields.  Every decode
checks the size first, then the format, then the fields; tensors are validated
against what the round expects (names, shapes, dtype, finiteness) before they may
reach an aggregator.

Topics, all under ``ioft/v1/<fleet>/``::

    task/<task>/down            retained  round announcement + global shared parameters
    task/<task>/down/<device>   retained  per-device downlink (algorithms that personalize it)
    task/<task>/up/<device>               a device's update for a round and phase
    status/<device>             retained  device status (JSON); the Last Will says offline

A device may only write ``.../up/<itself>`` and ``status/<itself>``; the broker's
ACL (``cloud-aggregator fleet init``) enforces it.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

PROTOCOL = "ioft/v1"
VERSION = 1
#: Default ceiling on a payload; mosquitto's own default limit is 256 MB.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_FLOATS = ("float32", "float64")


class WireError(ValueError):
    """A payload or topic that does not follow the protocol; the message is dropped."""


def check_id(kind: str, value: str) -> str:
    """Fleet, task and device ids are topic-safe: ``[a-z0-9][a-z0-9_-]{0,62}``."""
    if not isinstance(value, str) or not _ID.match(value):
        raise WireError(f"{kind} id {value!r} must match [a-z0-9][a-z0-9_-]{{0,62}}")
    return value


# -- topics -------------------------------------------------------------------
def topic_down(fleet: str, task: str) -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/task/{check_id('task', task)}/down"


def topic_down_device(fleet: str, task: str, device: str) -> str:
    return f"{topic_down(fleet, task)}/{check_id('device', device)}"


def topic_up(fleet: str, task: str, device: str) -> str:
    return (
        f"{PROTOCOL}/{check_id('fleet', fleet)}/task/{check_id('task', task)}/up/{check_id('device', device)}"
    )


def topic_up_all(fleet: str, task: str = "+") -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/task/{task}/up/+"


def topic_status(fleet: str, device: str) -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/status/{check_id('device', device)}"


def topic_status_all(fleet: str) -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/status/+"


@dataclass(frozen=True)
class Topic:
    """A parsed topic: ``kind`` is ``down``, ``down_device``, ``up`` or ``status``."""

    kind: str
    fleet: str
    task: str | None = None
    device: str | None = None


def parse_topic(topic: str) -> Topic:
    """Parse one of our topics; raises ``WireError`` for anything else."""
    parts = topic.split("/")
    if len(parts) < 4 or "/".join(parts[:2]) != PROTOCOL:
        raise WireError(f"not an {PROTOCOL} topic: {topic!r}")
    fleet, rest = check_id("fleet", parts[2]), parts[3:]
    if rest[0] == "status" and len(rest) == 2:
        return Topic("status", fleet, device=check_id("device", rest[1]))
    if rest[0] == "task" and len(rest) >= 3:
        task = check_id("task", rest[1])
        if rest[2] == "down" and len(rest) == 3:
            return Topic("down", fleet, task)
        if rest[2] == "down" and len(rest) == 4:
            return Topic("down_device", fleet, task, check_id("device", rest[3]))
        if rest[2] == "up" and len(rest) == 4:
            return Topic("up", fleet, task, check_id("device", rest[3]))
    raise WireError(f"unknown topic layout: {topic!r}")


# -- payloads -------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """What one uploaded tensor must look like."""

    shape: tuple[int, ...]
    dtype: str


def encode(kind: str, fields: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> bytes:
    """Serialize a message: ``fields`` must be JSON-able; tensors must be float arrays."""
    meta = {"v": VERSION, "kind": kind, **fields}
    arrays = {}
    for name, value in (tensors or {}).items():
        arr = np.ascontiguousarray(value)
        if arr.dtype.name not in _FLOATS:
            raise WireError(f"tensor {name!r} has dtype {arr.dtype}; the wire carries {_FLOATS}")
        arrays[name] = arr
    return st_save(arrays, metadata={"ioft": json.dumps(meta, separators=(",", ":"), sort_keys=True)})


def decode(
    payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse a payload into ``(fields, tensors)``: size, then format, then version.

    Raises
    ------
    WireError
        With a message saying what was wrong; the caller logs it and drops the message.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise WireError(f"payload must be bytes, got {type(payload).__name__}")
    size = len(payload)
    if size > max_bytes:
        raise WireError(f"payload of {size} bytes exceeds the limit of {max_bytes}")
    if size < 8:
        raise WireError(f"payload of {size} bytes is too short to be a message")
    payload = bytes(payload)
    try:
        tensors = st_load(payload)
        (header_len,) = struct.unpack("<Q", payload[:8])
        header = json.loads(payload[8 : 8 + header_len])
        meta = json.loads(header["__metadata__"]["ioft"])
    except (SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise WireError(f"malformed payload: {exc}") from None
    if not isinstance(meta, dict) or meta.get("v") != VERSION or not isinstance(meta.get("kind"), str):
        raise WireError(f"unsupported message header {str(meta)[:200]!r}; expected version {VERSION}")
    for name, arr in tensors.items():
        if arr.dtype.name not in _FLOATS:
            raise WireError(f"tensor {name!r} has dtype {arr.dtype}; the wire carries {_FLOATS}")
    return meta, tensors


def validate_tensors(tensors: dict[str, np.ndarray], expected: dict[str, TensorSpec]) -> None:
    """Names, shapes, dtype and finiteness against what the round expects."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise WireError(f"tensor names differ from the round's: missing {missing}, unexpected {extra}")
    for name, spec in expected.items():
        arr = tensors[name]
        if tuple(arr.shape) != tuple(spec.shape) or arr.dtype.name != spec.dtype:
            raise WireError(
                f"tensor {name!r} is {arr.dtype.name}{list(arr.shape)}, expected {spec.dtype}{list(spec.shape)}"
            )
        if not np.isfinite(arr).all():
            raise WireError(f"tensor {name!r} holds NaN or Inf")


def _field(meta: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = meta.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise WireError(f"field {key!r} missing or of wrong type (got {value!r})")
    return value


@dataclass(frozen=True)
class Announcement:
    """A round announcement, retained on ``task/<task>/down`` with the global shared parameters.

    ``spec`` is the task spec JSON (algorithm, model, hyperparameters); ``deadline``
    is a Unix time; ``global_hash`` identifies the parameters the round starts from.
    ``state`` is ``"running"`` or ``"done"`` (training finished).
    """

    fleet: str
    task: str
    round: int
    phase: str
    spec: str
    deadline: float
    global_hash: str
    state: str = "running"
    params: dict[str, np.ndarray] = field(default_factory=dict)

    def encode(self) -> bytes:
        fields = {
            k: getattr(self, k)
            for k in ("fleet", "task", "round", "phase", "spec", "deadline", "global_hash", "state")
        }
        return encode("round", fields, self.params)

    @classmethod
    def decode(cls, payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Announcement:
        meta, tensors = decode(payload, max_bytes=max_bytes)
        if meta["kind"] != "round":
            raise WireError(f"expected a round announcement, got kind {meta['kind']!r}")
        state = _field(meta, "state", str)
        if state not in ("running", "done"):
            raise WireError(f"round state must be 'running' or 'done', got {state!r}")
        return cls(
            fleet=check_id("fleet", _field(meta, "fleet", str)),
            task=check_id("task", _field(meta, "task", str)),
            round=_field(meta, "round", int),
            phase=_field(meta, "phase", str),
            spec=_field(meta, "spec", str),
            deadline=float(_field(meta, "deadline", (int, float))),
            global_hash=_field(meta, "global_hash", str),
            state=state,
            params=tensors,
        )


@dataclass(frozen=True)
class UpdateMessage:
    """A device's upload: only the algorithm's shared parameters, a sample count and scalar metrics."""

    fleet: str
    task: str
    device: str
    round: int
    phase: str
    n_samples: int
    global_hash: str
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, np.ndarray] = field(default_factory=dict)

    def encode(self) -> bytes:
        fields = {
            k: getattr(self, k)
            for k in ("fleet", "task", "device", "round", "phase", "n_samples", "global_hash")
        }
        fields["metrics"] = {k: float(v) for k, v in self.metrics.items()}
        return encode("update", fields, self.params)

    @classmethod
    def decode(cls, payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> UpdateMessage:
        meta, tensors = decode(payload, max_bytes=max_bytes)
        if meta["kind"] != "update":
            raise WireError(f"expected an update, got kind {meta['kind']!r}")
        metrics = _field(meta, "metrics", dict)
        if not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in metrics.items()
        ):
            raise WireError("metrics must map names to numbers")
        n_samples = _field(meta, "n_samples", int)
        if n_samples < 0:
            raise WireError(f"n_samples must be >= 0, got {n_samples}")
        return cls(
            fleet=check_id("fleet", _field(meta, "fleet", str)),
            task=check_id("task", _field(meta, "task", str)),
            device=check_id("device", _field(meta, "device", str)),
            round=_field(meta, "round", int),
            phase=_field(meta, "phase", str),
            n_samples=n_samples,
            global_hash=_field(meta, "global_hash", str),
            metrics={k: float(v) for k, v in metrics.items()},
            params=tensors,
        )

"""Named parameter dicts: the one currency of the trainer, the wire and the aggregator.

A ``Params`` maps a dotted name (``"decoder.weight"``) to an ``ndarray``.  The same
names travel in MQTT payloads and become ONNX initializer names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np

Params = dict[str, np.ndarray]


def copy_params(params: Mapping[str, np.ndarray]) -> Params:
    """A deep copy, so the caller's arrays are never mutated."""
    return {k: np.array(v, copy=True) for k, v in params.items()}


def cast_params(params: Mapping[str, np.ndarray], dtype: np.dtype | type) -> Params:
    """A copy with every array cast to ``dtype`` (the fleet trains in ``np.float32``)."""
    return {k: np.array(v, dtype=dtype, copy=True) for k, v in params.items()}


def select(params: Mapping[str, np.ndarray], names: Iterable[str]) -> Params:
    """The sub-dict of ``names``; raises ``KeyError`` naming every missing key."""
    names = list(names)
    missing = [n for n in names if n not in params]
    if missing:
        raise KeyError(f"missing parameters {missing}; have {sorted(params)}")
    return {n: params[n] for n in names}


def with_prefix(params: Mapping[str, np.ndarray], prefix: str) -> Params:
    """Prepend ``prefix + '.'`` to every name."""
    return {f"{prefix}.{k}": v for k, v in params.items()}


def strip_prefix(params: Mapping[str, np.ndarray], prefix: str) -> Params:
    """The entries under ``prefix + '.'``, with the prefix removed."""
    head = prefix + "."
    return {k[len(head) :]: v for k, v in params.items() if k.startswith(head)}


def param_hash(params: Mapping[str, np.ndarray]) -> str:
    """A sha256 over names, dtypes, shapes and bytes, independent of dict order."""
    h = hashlib.sha256()
    for name in sorted(params):
        arr = np.ascontiguousarray(params[name])
        h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def num_values(params: Mapping[str, np.ndarray]) -> int:
    """Total number of scalars."""
    return int(sum(np.asarray(v).size for v in params.values()))


def all_finite(params: Mapping[str, np.ndarray]) -> bool:
    """True when no entry holds NaN or Inf."""
    return all(np.isfinite(v).all() for v in params.values())


def l2_distance_sq(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """Squared Euclidean distance between two dicts with the same names."""
    return float(sum(np.sum((a[k] - b[k]) ** 2) for k in a))

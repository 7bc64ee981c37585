"""Fixed point in Z/2^r: a clipped, weighted update plus its weight, as one ring vector.

A device with weight w (capped at ``max_weight`` and divided by it, so in [0, 1]) and
update x encodes ``[round(w·clip(x)/step), round(w·L)]`` with ``L = 2^(bits-1) - 1`` and
``step = clip / L``; both sides use the quantized weight, so the decoded sums give the
weighted mean ``Σ w x / Σ w`` exactly up to each device's rounding (≤ step/2 per
coordinate).  :meth:`RoundParams` picks r so that n devices cannot overflow.
"""

from __future__ import annotations

import numpy as np

from ioft_protocol.secagg.config import RoundParams


def ring_dtype(p: RoundParams) -> np.dtype:
    return np.dtype(np.uint32 if p.ring_bits == 32 else np.uint64)


def levels(p: RoundParams) -> int:
    return (1 << (p.bits - 1)) - 1


def quantized_weight(p: RoundParams, weight: float) -> float:
    """The weight as both ends see it: min(w, max_weight)/max_weight on the grid 1/L."""
    if not np.isfinite(weight) or weight < 0:
        raise ValueError(f"weight must be finite and >= 0, got {weight}")
    return round(min(weight, p.max_weight) / p.max_weight * levels(p)) / levels(p)


def encode(p: RoundParams, update: np.ndarray, weight: float) -> np.ndarray:
    """The ring vector of length ``p.length + 1`` (last coordinate: the weight)."""
    x = np.asarray(update, dtype=np.float64).ravel()
    if x.shape != (p.length,):
        raise ValueError(f"update has {x.size} coordinates, the round expects {p.length}")
    if not np.all(np.isfinite(x)):
        raise ValueError("update holds NaN or Inf")
    w = quantized_weight(p, weight)
    scale = levels(p) / p.clip
    q = np.rint(w * np.clip(x, -p.clip, p.clip) * scale).astype(np.int64)
    q = np.append(q, round(w * levels(p)))
    return q.astype(ring_dtype(p))  # two's complement: negatives wrap into the ring


def decode_sum(p: RoundParams, total: np.ndarray) -> tuple[np.ndarray, float]:
    """``(Σ w·clip(x), Σ w)`` from the ring sum of encoded vectors."""
    bits = p.ring_bits
    signed = total.astype(np.int32 if bits == 32 else np.int64)
    values = signed[:-1].astype(np.float64) * (p.clip / levels(p))
    return values, float(signed[-1]) / levels(p)

"""Shared helpers of the SecAgg tests: a fleet of random updates and the plain sum to compare with."""

from __future__ import annotations

import numpy as np

from ioft_protocol.secagg import quantize, shamir
from ioft_protocol.secagg.config import RoundParams


def fleet(n: int, length: int, *, seed: int = 0, spread: float = 1.5) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    devices = [f"dev-{i:03d}" for i in range(n)]
    updates = {d: rng.uniform(-spread, spread, length) for d in devices}
    weights = {d: float(rng.integers(1, 50)) for d in devices}
    return updates, weights


def plain_sum(p: RoundParams, updates: dict, weights: dict, survivors) -> tuple[np.ndarray, float]:
    """The sum the survivors' encoded vectors give, decoded: what SecAgg must reproduce exactly."""
    half = 1 << (p.ring_bits - 1)
    signed = sum(_signed(quantize.encode(p, updates[d], weights[d]), half) for d in survivors)
    values = np.array([float(v) for v in signed[:-1]]) * (p.clip / quantize.levels(p))
    return values, float(signed[-1]) / quantize.levels(p)


def _signed(ring: np.ndarray, half: int) -> np.ndarray:
    """Two's complement read back as Python-sized integers (no wrap: the plain sum)."""
    return np.array([int(v) - 2 * half if int(v) >= half else int(v) for v in ring], dtype=object)


def rebuilds(shares: list[bytes], secret: bytes) -> bool:
    """Do these shares combine to ``secret``?  (Too few may not even give a 32-byte value.)"""
    try:
        return shamir.combine(shares) == secret
    except ValueError:
        return False

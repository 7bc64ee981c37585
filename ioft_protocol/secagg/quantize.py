"""Fixed point in Z/2^r: a clipped, weighted update plus its weight, as one ring vector.

A device with weight w (capped at ``max_weight`` and divided by it, so in [0, 1]) and
update x encodes ``[round(w·clip(x)/step), round(w·L)]`` with ``L = 2^(bits-1) - 1`` and
``step = clip / L``; both sides use the quantized weight, so the decoded sums give the
weighted mean ``Σ w x / Σ w`` exactly up to each device's rounding (≤ step/2 per
coordinate).  The ring is as narrow as n devices allow without overflow,
``r = bits + ceil(log2 n)`` bits (26 for 16-bit inputs and 1,000 devices): vectors are
held in uint64 reduced mod 2^r and travel packed, r bits per coordinate.
"""

from __future__ import annotations

import math

import numpy as np

from ioft_protocol.secagg import crypto
from ioft_protocol.secagg.config import RoundParams

RING_DTYPE = np.dtype(np.uint64)


def ring_bits(n: int, bits: int) -> int:
    """The narrowest r with n·(2^(bits-1) - 1) < 2^(r-1): the survivors' sum never wraps."""
    return bits + math.ceil(math.log2(max(n, 1)))


def levels(p: RoundParams) -> int:
    return (1 << (p.bits - 1)) - 1


def _modulus_mask(p: RoundParams) -> np.uint64:
    return np.uint64((1 << p.ring_bits) - 1)


def reduce(p: RoundParams, v: np.ndarray) -> np.ndarray:
    """``v`` mod 2^r (uint64 arithmetic wraps mod 2^64, a multiple of 2^r)."""
    return np.asarray(v, dtype=RING_DTYPE) & _modulus_mask(p)


def prg(p: RoundParams, seed: bytes, length: int) -> np.ndarray:
    """A uniform ring vector from ``seed`` (AES-256-CTR; 4 bytes of keystream per coordinate
    when r <= 32, the common case, else 8)."""
    words = crypto.mask(seed, length, np.uint32 if p.ring_bits <= 32 else RING_DTYPE)
    out = words.astype(RING_DTYPE)
    return np.bitwise_and(out, _modulus_mask(p), out=out)


def quantized_weight(p: RoundParams, weight: float) -> float:
    """The weight as both ends see it: min(w, max_weight)/max_weight on the grid 1/L."""
    if not np.isfinite(weight) or weight < 0:
        raise ValueError(f"weight must be finite and >= 0, got {weight}")
    return round(min(weight, p.max_weight) / p.max_weight * levels(p)) / levels(p)


def encode(p: RoundParams, update: np.ndarray, weight: float) -> np.ndarray:
    """The ring vector of length ``p.length + 1`` (last coordinate: the weight).

    With ``p.codes``, ``update`` holds compressed integer codes in ``[0, 2^codes - 1]``, summed
    as they are, and the last coordinate counts the device once (such rounds weigh uniformly)."""
    if p.codes:
        k = np.asarray(update).ravel()
        if k.shape != (p.length,):
            raise ValueError(f"update has {k.size} codes, the round expects {p.length}")
        if k.dtype.kind not in "ui" or (k.size and (k.min() < 0 or k.max() >= 1 << p.codes)):
            raise ValueError(f"codes must be integers in [0, {(1 << p.codes) - 1}]")
        return reduce(p, np.append(k.astype(RING_DTYPE), RING_DTYPE.type(1)))
    x = np.asarray(update, dtype=np.float64).ravel()
    if x.shape != (p.length,):
        raise ValueError(f"update has {x.size} coordinates, the round expects {p.length}")
    if not np.all(np.isfinite(x)):
        raise ValueError("update holds NaN or Inf")
    w = quantized_weight(p, weight)
    scale = levels(p) / p.clip
    q = np.rint(w * np.clip(x, -p.clip, p.clip) * scale).astype(np.int64)
    q = np.append(q, round(w * levels(p)))
    return reduce(p, q.astype(RING_DTYPE))  # two's complement: negatives wrap into the ring


def decode_sum(p: RoundParams, total: np.ndarray) -> tuple[np.ndarray, float]:
    """``(Σ w·clip(x), Σ w)`` from the ring sum of encoded vectors; with ``p.codes``, ``(Σ codes,
    count)``: the sum never reaches 2^r, so it is read unsigned."""
    t = reduce(p, total)
    if p.codes:
        return t[:-1].astype(np.float64), float(t[-1])
    signed = t.view(np.int64).copy()
    if p.ring_bits < 64:
        signed[t >= np.uint64(1 << (p.ring_bits - 1))] -= np.int64(1 << (p.ring_bits - 1)) * 2
    values = signed[:-1].astype(np.float64) * (p.clip / levels(p))
    return values, float(signed[-1]) / levels(p)


def _layout(r: int) -> tuple[int, int]:
    """Values per block and 64-bit words per block: r-bit fields tile 64-bit words every 64/gcd values."""
    g = math.gcd(r, 64)
    return 64 // g, r // g


def pack(p: RoundParams, v: np.ndarray) -> bytes:
    """``ceil(len·r/8)`` bytes: each coordinate's r low bits, one after another (little-endian)."""
    r, v = p.ring_bits, reduce(p, v)
    per, words = _layout(r)
    n = v.size
    cols = np.zeros((-(-n // per), per), dtype=RING_DTYPE)
    cols.ravel()[:n] = v
    out = np.zeros((cols.shape[0], words + 1), dtype=RING_DTYPE)
    for j in range(per):  # field j of every block at once: its word and shift are the same
        w, shift = divmod(j * r, 64)
        out[:, w] |= cols[:, j] << np.uint64(shift)
        if shift + r > 64:
            out[:, w + 1] |= cols[:, j] >> np.uint64(64 - shift)
    return out[:, :words].astype("<u8").tobytes()[: (n * r + 7) // 8]


def unpack(p: RoundParams, data: bytes, length: int) -> np.ndarray:
    """The inverse of :func:`pack`; ``ValueError`` if ``data`` is not ``length`` coordinates."""
    r = p.ring_bits
    if len(data) != (length * r + 7) // 8:
        raise ValueError(
            f"a packed vector of {length} × {r} bits is {(length * r + 7) // 8} bytes, got {len(data)}"
        )
    per, words = _layout(r)
    blocks = -(-length // per)
    buf = np.zeros(blocks * words * 8, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    packed = np.zeros((blocks, words + 1), dtype=RING_DTYPE)
    packed[:, :words] = buf.view("<u8").reshape(blocks, words)
    cols = np.empty((blocks, per), dtype=RING_DTYPE)
    for j in range(per):
        w, shift = divmod(j * r, 64)
        col = packed[:, w] >> np.uint64(shift)
        if shift + r > 64:
            col |= packed[:, w + 1] << np.uint64(64 - shift)
        cols[:, j] = col
    return reduce(p, cols.ravel()[:length])

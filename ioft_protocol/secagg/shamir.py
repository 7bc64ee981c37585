"""Shamir secret sharing of 32-byte secrets over GF(2^521 - 1) (a Mersenne prime > 2^256)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

PRIME = (1 << 521) - 1
SECRET_BYTES = 32
_Y_BYTES = 66  # ceil(521 / 8)
SHARE_BYTES = 2 + _Y_BYTES


def split(secret: bytes, xs: Sequence[int], threshold: int) -> dict[int, bytes]:
    """Shares of ``secret`` at the points ``xs`` (distinct, 1..65535); any ``threshold`` rebuild it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} must be in 1..{len(xs)} (the number of shares)")
    if len(set(xs)) != len(xs) or not all(0 < x < 1 << 16 for x in xs):
        raise ValueError("share points must be distinct integers in 1..65535")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[x] = x.to_bytes(2, "big") + y.to_bytes(_Y_BYTES, "big")
    return out


def combine(shares: Sequence[bytes]) -> bytes:
    """The secret from at least ``threshold`` shares (Lagrange interpolation at 0)."""
    points = []
    for s in shares:
        if len(s) != SHARE_BYTES:
            raise ValueError(f"a share is {SHARE_BYTES} bytes, got {len(s)}")
        points.append((int.from_bytes(s[:2], "big"), int.from_bytes(s[2:], "big")))
    xs = [x for x, _ in points]
    if not points or len(set(xs)) != len(xs):
        raise ValueError("combine needs shares at distinct points")
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * -xj % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * SECRET_BYTES):
        raise ValueError("shares do not combine to a 32-byte secret (too few or corrupt shares)")
    return secret.to_bytes(SECRET_BYTES, "big")

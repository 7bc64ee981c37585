"""SecAgg+'s communication graph: a Harary graph H(k, n) on randomly permuted devices.

Bell et al. (CCS 2020, §3) show that a random k-regular-like graph with k = O(log n)
keeps the sum private and robust to dropouts; the Harary graph (each node joined to the
k/2 nearest on each side of a ring) with random labels is their construction.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def default_degree(n: int) -> int:
    """An even k ≈ 2·log2(n), at most n - 1 (the complete graph for small fleets)."""
    if n <= 1:
        return 0
    k = 2 * math.ceil(math.log2(n))
    return min(n - 1, k + (k % 2))


def harary(devices: Sequence[str], degree: int, rng: random.Random) -> dict[str, frozenset[str]]:
    """Neighbours of each device; ``degree`` is clamped to n - 1 (odd degrees round up)."""
    order = sorted(devices)
    rng.shuffle(order)
    n = len(order)
    if degree >= n - 1:
        return {d: frozenset(order) - {d} for d in order}
    half = (degree + 1) // 2
    nbrs: dict[str, set[str]] = {d: set() for d in order}
    for i, d in enumerate(order):
        for j in range(1, half + 1):
            for other in (order[(i + j) % n], order[(i - j) % n]):
                nbrs[d].add(other)
                nbrs[other].add(d)
    return {d: frozenset(s) for d, s in nbrs.items()}

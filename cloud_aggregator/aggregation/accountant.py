"""How much privacy a DP task has spent: ε at δ from Google's ``dp-accounting`` (RDP).

Each completed round releases one subsampled Gaussian sum: every device is in the round
with probability ``q`` (the sampling rate) and the sum carries ``N(0, (z·C)²)`` with each
device's change clipped to ``C``.  We compose ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``
once per round in the Rényi accountant (Mironov 2017; Abadi et al. 2016's moments
accountant) and convert to ε at the task's δ.  A fleet that draws a fixed number of
devices without replacement is accounted as Poisson with the same rate, the usual
approximation (McMahan et al. 2018 do the same).

A round whose sum carried less noise than planned (distributed mode with fewer devices
than ``devices_per_round``: each adds ``σ²/n``) is composed with the smaller multiplier it
really had, so ε never understates what was released.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

import dp_accounting
from dp_accounting.rdp import RdpAccountant

log = logging.getLogger(__name__)


def epsilon(multipliers: Iterable[float], sampling_rate: float, delta: float) -> float:
    """ε at ``delta`` after one subsampled Gaussian release per entry of ``multipliers``."""
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling rate must lie in (0, 1], got {sampling_rate}")
    accountant = RdpAccountant()
    for z, count in sorted(Counter(round(float(m), 12) for m in multipliers).items()):
        if z <= 0:
            return math.inf
        event = dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(z))
        accountant.compose(dp_accounting.SelfComposedDpEvent(event, count))
    return float(accountant.get_epsilon(delta))


def calibrate(target_epsilon: float, rounds: int, sampling_rate: float, delta: float) -> float:
    """A noise multiplier within 0.1 % of the smallest whose ``rounds`` releases stay within
    ``target_epsilon`` (bisection; it never overshoots the target)."""
    if not target_epsilon > 0 or rounds < 1:
        raise ValueError(f"need target_epsilon > 0 and rounds >= 1, got {target_epsilon}, {rounds}")
    lo, hi = 1e-3, 1.0
    while epsilon([hi] * rounds, sampling_rate, delta) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(f"no noise multiplier below 1e4 reaches ε = {target_epsilon}")
    while hi - lo > 1e-3 * hi:  # 0.1 %: finer than any figure we report
        mid = (lo + hi) / 2
        if epsilon([mid] * rounds, sampling_rate, delta) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


class PrivacyLedger:
    """A task's spent privacy: the multiplier of every completed round, and ε from them.

    Parameters
    ----------
    sampling_rate, delta
        The accountant's ``q`` and the δ ε is reported at.
    budget
        ``epsilon_budget``: :meth:`stop_reason` says stop before a round that would pass it.
    """

    def __init__(self, sampling_rate: float, delta: float, budget: float | None = None) -> None:
        self.sampling_rate = sampling_rate
        self.delta = delta
        self.budget = budget
        self.multipliers: list[float] = []

    def spend(self, multiplier: float) -> float:
        """Record one released round; returns ε after it."""
        self.multipliers.append(float(multiplier))
        return self.epsilon()

    def epsilon(self) -> float:
        """ε spent so far (0 before any round)."""
        if not self.multipliers:
            return 0.0
        return epsilon(self.multipliers, self.sampling_rate, self.delta)

    def stop_reason(self, planned: float) -> str | None:
        """Why the next round (with multiplier ``planned``) must not run; ``None`` while within budget."""
        if self.budget is None:
            return None
        after = epsilon([*self.multipliers, planned], self.sampling_rate, self.delta)
        if after <= self.budget:
            return None
        return (
            f"ε budget {self.budget:g} reached: {len(self.multipliers)} rounds spent ε = {self.epsilon():.3f} "
            f"at δ = {self.delta:g}; one more would make it {after:.3f}"
        )

    def summary(self) -> dict[str, Any]:
        """What a round record keeps: ε, δ, rounds composed, the budget."""
        out: dict[str, Any] = {
            "epsilon": round(self.epsilon(), 6),
            "delta": self.delta,
            "rounds": len(self.multipliers),
            "sampling_rate": self.sampling_rate,
        }
        if self.budget is not None:
            out["budget"] = self.budget
        return out

    def state(self) -> list[float]:
        return list(self.multipliers)

    def load_state(self, multipliers: Iterable[float]) -> None:
        self.multipliers = [float(m) for m in multipliers]

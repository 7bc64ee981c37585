"""How weighted uploads are combined into one set of parameters, chosen by name.

A reducer is built from keyword arguments and called as
``reduce(global_params, [(params, weight), ...]) -> Params``.  The weighted mean is
the default; robust options (clipping, median, trimmed mean, Krum) register here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from cloud_aggregator.aggregation.mean import check_consistent, weighted_mean
from trainer_lite.params import Params


class Reducer(Protocol):
    def __call__(
        self, global_params: Params, updates: Sequence[tuple[Mapping[str, np.ndarray], float]]
    ) -> Params: ...


_REDUCERS: dict[str, Callable[..., Reducer]] = {}


def register_reducer(name: str) -> Callable[[Callable[..., Reducer]], Callable[..., Reducer]]:
    def deco(factory: Callable[..., Reducer]) -> Callable[..., Reducer]:
        if name in _REDUCERS:
            raise ValueError(f"reducer {name!r} registered twice")
        _REDUCERS[name] = factory
        return factory

    return deco


def get_reducer(name: str, args: dict[str, Any] | None = None) -> Reducer:
    """Build the named reducer; the error lists the valid names."""
    try:
        factory = _REDUCERS[name]
    except KeyError:
        raise ValueError(f"unknown reducer {name!r}; choose one of {sorted(_REDUCERS)}") from None
    return factory(**(args or {}))


@dataclass(frozen=True)
class ReducerChoice:
    """The reducer fields of a strategy's server config, shared so every mean-based strategy
    takes the same ``server = {reducer = "krum", reducer_args = {f = 4, m = 8}}``."""

    reducer: str = "mean"
    reducer_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        get_reducer(self.reducer, self.reducer_args)  # fail at config time, naming the choices

    def make_reducer(self) -> Reducer:
        return get_reducer(self.reducer, self.reducer_args)


@register_reducer("mean")
def mean() -> Reducer:
    """``Σ w_i θ_i / Σ w_i`` (FedAvg)."""
    return lambda global_params, updates: weighted_mean(updates)


# -- robust reducers ----------------------------------------------------------------------
# Byzantine-robust rules from the literature.  Each works on the flattened change
# ``Δ_i = θ_i − g`` from the global the round started from (names in sorted order,
# float64), and returns ``g + Δ`` cast back to each tensor's dtype.  Median, trimmed
# mean and Krum are translation invariant, so working on deltas only matters for
# clipping; it also keeps float64 sums small.  Uploads of weight 0 take no part.


def _flatten(
    global_params: Params, updates: Sequence[tuple[Mapping[str, np.ndarray], float]]
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """``(names, base, deltas (n × P), weights)`` over the updates with weight > 0."""
    names = check_consistent(updates)
    first = updates[0][0]
    base = np.concatenate(
        [
            np.ravel(np.asarray(global_params[n], dtype=np.float64))
            if n in global_params and np.shape(global_params[n]) == np.shape(first[n])
            else np.zeros(np.size(first[n]))
            for n in names
        ]
        or [np.zeros(0)]
    )
    kept = [(p, w) for p, w in updates if w > 0]
    if not kept:
        raise ValueError("total weight is zero")
    deltas = np.stack(
        [
            np.concatenate([np.ravel(np.asarray(p[n], dtype=np.float64)) for n in names] or [np.zeros(0)])
            for p, _ in kept
        ]
    )
    deltas -= base
    return names, base, deltas, np.array([w for _, w in kept], dtype=np.float64)


def _unflatten(names: list[str], like: Mapping[str, np.ndarray], flat: np.ndarray) -> Params:
    out: Params = {}
    start = 0
    for n in names:
        ref = np.asarray(like[n])
        out[n] = flat[start : start + ref.size].reshape(ref.shape).astype(ref.dtype)
        start += ref.size
    return out


def _combine(global_params: Params, updates, rule: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Params:
    """``g + rule(deltas, weights)``, in each uploaded tensor's dtype."""
    names, base, deltas, weights = _flatten(global_params, updates)
    return _unflatten(names, updates[0][0], base + rule(deltas, weights))


def _wmean(deltas: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return weights @ deltas / weights.sum()


@register_reducer("clip")
def clip(max_norm: float | None = None, scale: float = 1.0) -> Reducer:
    """Clip each ``Δ_i`` to norm ``τ``, then the weighted mean (Sun et al. 2019, "Can you really backdoor FL?").

    ``max_norm`` fixes ``τ``; without it ``τ = scale × median_i ‖Δ_i‖`` from this round,
    which adapts to the model's scale and which a minority of attackers cannot inflate.
    """
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"clip: max_norm must be > 0, got {max_norm}")
    if not scale > 0:
        raise ValueError(f"clip: scale must be > 0, got {scale}")

    def rule(deltas: np.ndarray, weights: np.ndarray) -> np.ndarray:
        norms = np.linalg.norm(deltas, axis=1)
        tau = max_norm if max_norm is not None else scale * float(np.median(norms))
        factor = np.minimum(1.0, tau / np.maximum(norms, np.finfo(np.float64).tiny))
        return _wmean(deltas * factor[:, None], weights)

    return lambda global_params, updates: _combine(global_params, updates, rule)


@register_reducer("median")
def median() -> Reducer:
    """Coordinate-wise median (Yin et al. 2018); unweighted: a weight could be claimed by an attacker."""
    return lambda global_params, updates: _combine(global_params, updates, lambda d, w: np.median(d, axis=0))


@register_reducer("trimmed_mean")
def trimmed_mean(beta: float = 0.1) -> Reducer:
    """Coordinate-wise β-trimmed mean (Yin et al. 2018): drop the ⌊βn⌋ largest and smallest, average the rest.

    Unweighted like the median; ``0 <= beta < 0.5``.
    """
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean: beta must be in [0, 0.5), got {beta}")

    def rule(deltas: np.ndarray, weights: np.ndarray) -> np.ndarray:
        n = deltas.shape[0]
        k = int(np.floor(beta * n))
        if k == 0:
            return deltas.mean(axis=0)
        return np.sort(deltas, axis=0)[k : n - k].mean(axis=0)

    return lambda global_params, updates: _combine(global_params, updates, rule)


def krum_scores(deltas: np.ndarray, f: int) -> np.ndarray:
    """Krum's score of each row: the sum of squared distances to its ``n − f − 2`` nearest others.

    With ``n <= f + 2`` (too few uploads for the rule) the nearest one counts, so the
    reducer degrades gracefully instead of failing the round.
    """
    n = deltas.shape[0]
    sq = np.sum(deltas**2, axis=1)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * deltas @ deltas.T, 0.0)
    np.fill_diagonal(dist, np.inf)
    k = min(max(n - f - 2, 1), n - 1)
    if k <= 0:
        return np.zeros(n)
    return np.sort(dist, axis=1)[:, :k].sum(axis=1)


@register_reducer("krum")
def krum(f: int = 1, m: int = 1) -> Reducer:
    """(Multi-)Krum (Blanchard et al. 2017): the ``m`` uploads with the lowest :func:`krum_scores`, weighted mean.

    ``f`` is the number of Byzantine uploads tolerated (needs ``n > 2f + 2``); ``m = 1``
    is Krum, ``m > 1`` Multi-Krum.  Ties break by upload order (the round engine sorts by device).
    """
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(f"krum: f must be an int >= 0, got {f!r}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"krum: m must be an int >= 1, got {m!r}")

    def rule(deltas: np.ndarray, weights: np.ndarray) -> np.ndarray:
        scores = krum_scores(deltas, f)
        best = np.argsort(scores, kind="stable")[: min(m, len(scores))]
        return _wmean(deltas[best], weights[best])

    return lambda global_params, updates: _combine(global_params, updates, rule)

"""Aggregation as pure functions over ``list[(params, weight)]``: no transport, no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from trainer_lite.params import Params

Weighted = tuple[Mapping[str, np.ndarray], float]


def check_consistent(updates: Sequence[Weighted]) -> list[str]:
    """Names shared by all updates; raises ``ValueError`` naming the first key or shape mismatch."""
    if not updates:
        raise ValueError("nothing to aggregate: no updates")
    first = updates[0][0]
    names = sorted(first)
    for i, (params, weight) in enumerate(updates):
        if sorted(params) != names:
            raise ValueError(f"update {i} has names {sorted(params)}, expected {names}")
        for n in names:
            if params[n].shape != first[n].shape:
                raise ValueError(f"update {i}: {n!r} has shape {params[n].shape}, expected {first[n].shape}")
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"update {i} has invalid weight {weight}")
    return names


class WeightedMean:
    """Streaming weighted mean: memory O(parameters), not O(devices × parameters).

    Accumulates in float64 whatever the input dtype; ``result`` casts back.

    Examples
    --------
    >>> import numpy as np
    >>> acc = WeightedMean()
    >>> acc.add({"w": np.array([1.0], np.float32)}, 3.0)
    >>> acc.add({"w": np.array([5.0], np.float32)}, 1.0)
    >>> out = acc.result()["w"]
    >>> out.tolist(), out.dtype.name, acc.total_weight
    ([2.0], 'float32', 4.0)
    """

    def __init__(self) -> None:
        self._sum: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, params: Mapping[str, np.ndarray], weight: float) -> None:
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        if self._sum and sorted(params) != sorted(self._sum):
            raise ValueError(f"update names {sorted(params)} differ from {sorted(self._sum)}")
        for n, v in params.items():
            v = np.asarray(v)
            if n not in self._sum:
                self._sum[n] = np.zeros(v.shape, dtype=np.float64)
                self._dtypes[n] = v.dtype
            elif self._sum[n].shape != v.shape:
                raise ValueError(f"{n!r} has shape {v.shape}, expected {self._sum[n].shape}")
            self._sum[n] += weight * v
        self.total_weight += weight
        self.count += 1

    def result(self) -> Params:
        if self.count == 0:
            raise ValueError("nothing to aggregate: no updates")
        if self.total_weight <= 0:
            raise ValueError("total weight is zero")
        return {n: (s / self.total_weight).astype(self._dtypes[n]) for n, s in self._sum.items()}


def weighted_mean(updates: Sequence[Weighted]) -> Params:
    """``Σ w_i θ_i / Σ w_i`` per name (FedAvg's server step).

    Examples
    --------
    A device with twice the samples counts twice:

    >>> import numpy as np
    >>> mean = weighted_mean([({"w": np.array([0.0, 2.0])}, 1.0), ({"w": np.array([3.0, 5.0])}, 2.0)])
    >>> mean["w"].tolist()
    [2.0, 4.0]
    """
    check_consistent(updates)
    acc = WeightedMean()
    for params, weight in updates:
        acc.add(params, weight)
    return acc.result()

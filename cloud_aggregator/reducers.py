"""How weighted uploads are combined into one set of parameters, chosen by name.

A reducer is built from keyword arguments and called as
``reduce(global_params, [(params, weight), ...]) -> Params``.  The weighted mean is
the default; robust options (clipping, median, trimmed mean, Krum) register here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from cloud_aggregator.aggregate import weighted_mean
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


@register_reducer("mean")
def mean() -> Reducer:
    """``Σ w_i θ_i / Σ w_i`` (FedAvg)."""
    return lambda global_params, updates: weighted_mean(updates)

"""How much each upload counts in a FedAvg-style aggregation, chosen by name.

A weighting is built from keyword arguments and called as ``weigh(updates, round_)``
returning one non-negative weight per update.  Stateful schemes may also offer
``state()`` / ``load_state()`` so a restarted aggregator resumes them exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # strategies import this module; avoid the cycle at run time
    from cloud_aggregator.strategies.base import Update


class Weighting(Protocol):
    def __call__(self, updates: Sequence[Update], round_: int) -> list[float]: ...


_WEIGHTINGS: dict[str, Callable[..., Weighting]] = {}


def register_weighting(name: str) -> Callable[[Callable[..., Weighting]], Callable[..., Weighting]]:
    def deco(factory: Callable[..., Weighting]) -> Callable[..., Weighting]:
        if name in _WEIGHTINGS:
            raise ValueError(f"weighting {name!r} registered twice")
        _WEIGHTINGS[name] = factory
        return factory

    return deco


def get_weighting(name: str, args: dict[str, Any] | None = None) -> Weighting:
    """Build the named weighting; the error lists the valid names."""
    try:
        factory = _WEIGHTINGS[name]
    except KeyError:
        raise ValueError(f"unknown weighting {name!r}; choose one of {sorted(_WEIGHTINGS)}") from None
    return factory(**(args or {}))


@register_weighting("samples")
def samples() -> Weighting:
    """Weight by local sample count (McMahan et al. 2017)."""
    return lambda updates, round_: [float(u.n_samples) for u in updates]


@register_weighting("uniform")
def uniform() -> Weighting:
    """Every participant counts the same (PFL-DA's p_i = 1/N)."""
    return lambda updates, round_: [1.0] * len(updates)

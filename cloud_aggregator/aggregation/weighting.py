"""How much each upload counts in a FedAvg-style aggregation, chosen by name.

A weighting is built from keyword arguments and called as ``weigh(updates, round_)``
returning one non-negative weight per update.  Stateful schemes may also offer
``state()`` / ``load_state()`` so a restarted aggregator resumes them exactly.

Whatever the weighting, no upload's sample count counts more than ``max_weight_ratio`` (a
``TaskSpec.server`` key, default :data:`DEFAULT_MAX_WEIGHT_RATIO`) times the round's median
(:func:`cap_samples`, applied by ``cloud_aggregator.rounds.engine`` before any strategy weighs
the round): a device that claims a million rows where the others have a hundred counts as three
hundred, not 99.99 % of the mean.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from cloud_aggregator.aggregation.update import Update

log = logging.getLogger(__name__)


#: ``TaskSpec.server`` key of the weight cap (not a strategy's field: every strategy takes it).
MAX_WEIGHT_RATIO = "max_weight_ratio"
#: By default an upload's sample count counts at most this multiple of the round's median.
DEFAULT_MAX_WEIGHT_RATIO = 3.0


def max_weight_ratio(server: Mapping[str, Any]) -> float | None:
    """The task's weight cap as a multiple of the median (``None``: ``max_weight_ratio = false``, off)."""
    value = server.get(MAX_WEIGHT_RATIO, DEFAULT_MAX_WEIGHT_RATIO)
    if value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 1:
        raise ValueError(
            f"server.{MAX_WEIGHT_RATIO} = {value!r}: a number >= 1, or false to turn the cap off"
        )
    return float(value)


def strategy_args(server: Mapping[str, Any]) -> dict[str, Any]:
    """``server`` without the keys every strategy shares (what a strategy's config validates)."""
    max_weight_ratio(server)  # a bad cap fails with the config, naming the key
    return {k: v for k, v in server.items() if k != MAX_WEIGHT_RATIO}


def sample_cap(counts: Sequence[int], ratio: float) -> int:
    """The most samples one upload counts: ``ratio ×`` the median of ``counts`` (at least 1)."""
    return max(1, math.floor(ratio * float(np.median(counts)))) if len(counts) else 1


def cap_samples(
    updates: Sequence[Update], ratio: float | None, cap: int | None = None
) -> tuple[list[Update], dict[str, tuple[int, int]]]:
    """``updates`` with each ``n_samples`` cut to ``cap`` (default: :func:`sample_cap` of theirs),
    and ``{device: (claimed, counted)}`` for those cut.  ``ratio`` ``None``: unchanged, nothing cut.

    A pure function of the round: the simulator and the MQTT fleet cut the same uploads alike.
    """
    if ratio is None or not updates:
        return list(updates), {}
    most = sample_cap([u.n_samples for u in updates], ratio) if cap is None else cap
    cut = {u.device: (u.n_samples, most) for u in updates if u.n_samples > most}
    return [dataclasses.replace(u, n_samples=most) if u.device in cut else u for u in updates], cut


def capped_weight(weight: Callable[[Update], float], cap: int) -> Callable[[Update], float]:
    """A per-upload ``weight`` (a fold's) that sees each upload's sample count cut to ``cap``."""

    def weigh(u: Update) -> float:
        return weight(u if u.n_samples <= cap else dataclasses.replace(u, n_samples=cap))

    return weigh


class Weighting(Protocol):
    """Per-upload weights for a round, and what of them survives a restart."""

    def __call__(self, updates: Sequence[Update], round_: int) -> list[float]: ...
    def state(self) -> dict[str, Any]: ...
    def load_state(self, state: dict[str, Any]) -> None: ...


class StatelessWeighting:
    """A weighting that is a function of the round's uploads alone: nothing to save."""

    def __init__(
        self,
        name: str,
        weigh: Callable[[Sequence[Update], int], list[float]],
        per_update: Callable[[Update], float] | None = None,
    ) -> None:
        self.name = name
        self._weigh = weigh
        #: Each upload's weight from that upload alone, where the scheme has one: a round can
        #: then fold uploads as they arrive (``cloud_aggregator.aggregation.streaming``).
        self.per_update = per_update

    def __call__(self, updates: Sequence[Update], round_: int) -> list[float]:
        return self._weigh(updates, round_)

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"weighting {self.name!r} keeps no state, got {sorted(state)}")


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
    return StatelessWeighting(
        "samples", lambda updates, round_: [float(u.n_samples) for u in updates], lambda u: float(u.n_samples)
    )


@register_weighting("uniform")
def uniform() -> Weighting:
    """Every participant counts the same (PFL-DA's p_i = 1/N)."""
    return StatelessWeighting("uniform", lambda updates, round_: [1.0] * len(updates), lambda u: 1.0)


# F_i(w) by default: the downlinked model's loss on the device's training rows, as
# FedAvg's client (``train_loss_start``) and PerPCA's (``start_loss``) name it.
GIFAIR_DEFAULT_METRICS = ("train_loss_start", "start_loss")


class GifairWeighting:
    """GIFAIR-FL's group-fair reweighting (Yue, Nouiehed & Kontar, INFORMS J. Data Sci. 2023; arXiv 2108.02741).

    GIFAIR-FL-Global minimises ``Σ_i p_i F_i(w) + λ Σ_{a<b} |L_a(w) − L_b(w)|`` with
    group losses ``L_a = (1/|A_a|) Σ_{i∈A_a} F_i``; its gradient rewrites it as a
    client reweighting (the talk's "More details" slide)::

        H(w) = Σ_i p_i (1 + λ r_i(w) / (p_i |A_{s_i}|)) F_i(w),
        r_i(w) = Σ_{a ≠ s_i} sign(L_{s_i}(w) − L_a(w)),

    so device ``i`` of group ``s_i`` gets weight ``p_i + λ r_i / |A_{s_i}|``: a group
    whose loss ranks above ``k`` others and below ``j`` gains ``λ (k − j)`` of mass,
    shared by its members.  Because ``r`` is antisymmetric over the groups, the
    weights still sum to ``Σ p_i`` when every group is present, so the weighted mean
    of uploads made by one local gradient step is exactly one step on ``H``.

    What is measured where:

    * ``F_i(w)`` is read from each upload's ``metrics[loss_metric]``.  The talk
      defines ``F_i`` as device ``i``'s *training* loss and ranks groups at the
      current global model ``w``, so the default (``loss_metric=None``) reads the
      downlinked model's loss on the device's training rows, before the local
      step: FedAvg's client reports it as ``train_loss_start``
      (:class:`trainer_lite.algorithms.fedavg.FedAvgClient`), PerPCA's as
      ``start_loss``; the first of :data:`GIFAIR_DEFAULT_METRICS` an upload
      carries is used.  Any other scalar metric can be named instead, e.g.
      ``"test_loss"`` (the downlinked model on the device's held-out split, from
      :func:`trainer_lite.client.participate`) -- but a study that scores the
      final group losses on that same split then steers the weights by its
      evaluation data.
    * ``p_i`` is the base weighting (``"samples"`` or ``"uniform"``), normalised over
      the round's uploads; ``|A_a|`` counts the round's uploads from group ``a``.
    * A group with no upload this round keeps its last known loss (persisted by
      :meth:`state`), so partial participation still ranks it; a group never seen
      is left out of ``r_i``.

    Weights must stay non-negative: that needs ``λ ≤ p_i |A_{s_i}| / (G − 1)`` for
    every device (G groups; ``|r_i| ≤ G − 1``).  A larger ``λ`` is allowed: the
    weights that would go negative are clipped to zero, with a warning.
    """

    def __init__(
        self,
        lam: float,
        groups: dict[str, str],
        base: str = "samples",
        loss_metric: str | None = None,
    ) -> None:
        if not (isinstance(lam, int | float) and np.isfinite(lam) and lam >= 0):
            raise ValueError(f"gifair: lam must be a finite number >= 0, got {lam!r}")
        if not groups:
            raise ValueError("gifair: groups must map every device id to its group name")
        if base not in ("samples", "uniform"):
            raise ValueError(f"gifair: base must be 'samples' or 'uniform', got {base!r}")
        self.lam = float(lam)
        self.groups = {str(k): str(v) for k, v in groups.items()}
        self.base = base
        if loss_metric is not None and not (isinstance(loss_metric, str) and loss_metric):
            raise ValueError(f"gifair: loss_metric must be a metric name or None, got {loss_metric!r}")
        self.loss_metric = loss_metric
        self.group_loss: dict[str, float] = {}  # last known L_a, persisted
        self.last: dict[str, Any] = {}  # the last round's r_i and weights, for studies and logs

    def __call__(self, updates: Sequence[Update], round_: int) -> list[float]:
        devices = [u.device for u in updates]
        unknown = sorted(set(devices) - set(self.groups))
        if unknown:
            raise ValueError(f"gifair: devices {unknown} have no group; add them to weighting_args['groups']")
        losses = [self._loss(u) for u in updates]
        base = np.array([float(u.n_samples) if self.base == "samples" else 1.0 for u in updates])
        if base.sum() <= 0:
            raise ValueError("gifair: the base weights sum to zero (every upload has n_samples = 0)")
        p = base / base.sum()
        member = [self.groups[d] for d in devices]
        size: dict[str, int] = {}
        fresh: dict[str, list[float]] = {}
        for g, loss in zip(member, losses, strict=True):
            size[g] = size.get(g, 0) + 1
            fresh.setdefault(g, []).append(loss)
        group_loss = {**self.group_loss, **{g: float(np.mean(v)) for g, v in fresh.items()}}
        if not all(np.isfinite(v) for v in group_loss.values()):
            raise ValueError(f"gifair: group losses must be finite, got {group_loss}")
        # r_i: how many groups this group's loss exceeds minus how many exceed it.
        rank = {g: sum(np.sign(group_loss[g] - group_loss[a]) for a in group_loss if a != g) for g in fresh}
        weights = p + self.lam * np.array([rank[g] / size[g] for g in member])
        if (weights < 0).any():
            log.warning(
                "gifair: lam = %g makes %d weights negative (the bound is lam <= p_i |A_si| / (G - 1)); "
                "clipping them to 0",
                self.lam,
                int((weights < 0).sum()),
            )
            weights = np.maximum(weights, 0.0)
        self.group_loss = group_loss
        self.last = {
            "round": round_,
            "rank": {g: float(r) for g, r in rank.items()},
            "group_loss": group_loss,
        }
        return [float(w) for w in weights]

    def _loss(self, u: Update) -> float:
        """``F_i(w)`` from one upload's metrics (see the class docstring)."""
        names = (self.loss_metric,) if self.loss_metric is not None else GIFAIR_DEFAULT_METRICS
        for name in names:
            if name in u.metrics:
                return float(u.metrics[name])
        want = repr(self.loss_metric) if self.loss_metric is not None else f"among {list(names)}"
        raise ValueError(
            f"gifair: the upload of {u.device!r} has no metric {want} (it has {sorted(u.metrics)}); "
            "use a client that reports its training loss at the downlinked model (fedavg, perpca) "
            "or set weighting_args['loss_metric'] to a metric the clients report"
        )

    def state(self) -> dict[str, Any]:
        return {"group_loss": dict(self.group_loss)} if self.group_loss else {}

    def load_state(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"group_loss"}
        if unknown:
            raise ValueError(f"gifair: unknown state keys {sorted(unknown)}; expected 'group_loss'")
        self.group_loss = {str(g): float(v) for g, v in state.get("group_loss", {}).items()}


@register_weighting("gifair")
def gifair(
    lam: float, groups: dict[str, str], base: str = "samples", loss_metric: str | None = None
) -> Weighting:
    """GIFAIR-FL group-fair weights ``p_i + λ r_i / |A_{s_i}|`` (see :class:`GifairWeighting`)."""
    return GifairWeighting(lam, groups, base, loss_metric)

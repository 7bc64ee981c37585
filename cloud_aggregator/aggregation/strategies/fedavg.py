"""FedAvg's server step: a (weighted, optionally robust) mean of the shared parameters.

Serves every client algorithm whose ``server`` is ``"fedavg"``: those whose server
side combines what was uploaded into one shared model, e.g. FedAvg itself, PFL-DA
and Simple-DA (the decoder w, §2.3: ``w = (1/N) Σ w_i``), FedRep (the body),
the transport benchmark's ``echo``, and local-only training (nothing shared: the
mean of empty dicts is empty).

Two pluggable parts, each chosen by name in ``TaskSpec.server``:

``weighting``
    How much each upload counts (``cloud_aggregator.aggregation.weighting``): ``"samples"``
    (McMahan et al.), ``"uniform"`` (PFL-DA's p_i = 1/N), or fairness-aware schemes.
``reducer``
    How the weighted uploads are combined (``cloud_aggregator.aggregation.reducers``):
    ``"mean"`` by default, or a Byzantine-robust rule: ``"clip"`` (norm clipping,
    then the mean), ``"median"``, ``"trimmed_mean"`` (β) or ``"krum"`` (f, m:
    Multi-Krum), e.g. ``server = {reducer = "krum", reducer_args = {f = 4, m = 8}}``.
    The same two fields choose the reducer of FTL-TP, FedDAR-WA, separate
    FedAvg and PerPCA (before its polar retraction).  Median and trimmed mean ignore weights; with ``"samples"`` weighting
    a device can inflate its own weight, so pair robust reducers with ``"uniform"``
    where n_samples is not trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cloud_aggregator.aggregation.reducers import ReducerChoice
from cloud_aggregator.aggregation.strategies.base import Strategy, register_strategy
from cloud_aggregator.aggregation.strategies.privacy import PrivateMean
from cloud_aggregator.aggregation.streaming import RoundFold
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.aggregation.weighting import get_weighting
from trainer_lite.params import Params


@dataclass(frozen=True)
class FedAvgConfig(ReducerChoice):
    """Server settings of a FedAvg-style strategy (see the module docstring)."""

    weighting: str = "samples"
    weighting_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        get_weighting(self.weighting, self.weighting_args)


@register_strategy
class FedAvg(Strategy):
    name = "fedavg"
    config_cls = FedAvgConfig
    accepts_late_updates = True
    dp_modes = ("central", "distributed")
    secagg = True

    def __init__(self, spec, client=None) -> None:
        super().__init__(spec, client)
        self.weigh = get_weighting(self.config.weighting, self.config.weighting_args)
        self.reduce = self.config.make_reducer()
        if self.dp is not None:
            if self.dp.devices_per_round is None:
                raise ValueError(
                    "dp with the fedavg server needs devices_per_round: the fixed denominator of the "
                    "mean (how many devices a round expects)"
                )
            self.privacy = PrivateMean(self.dp, self.dp.sampling_rate())

    def aggregate(
        self, global_params: Params, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        if not global_params:
            return {}
        if self.privacy is not None:  # DP-FedAvg: every device counts once, fixed denominator
            n = self.privacy.cfg.devices_per_round
            out = self.privacy.mean(global_params, [u.params for u in updates], n)
            self.privacy.release(self.spec.name, round_, len(updates), n)
            return out
        weights = self.weigh(updates, round_)
        return self.reduce(global_params, [(u.params, w) for u, w in zip(updates, weights, strict=True)])

    def fold(self, phase: str) -> RoundFold | None:
        """Folds uploads as they arrive where the mean is plain: the ``mean`` reducer, a weighting
        with a per-upload weight (``samples``, ``uniform``), and no DP (its mean clips and noises
        the round as a whole)."""
        per_update = getattr(self.weigh, "per_update", None)
        if (
            type(self).aggregate is not FedAvg.aggregate
            and type(self).aggregate_folded is FedAvg.aggregate_folded
        ):
            return None  # a subclass with its own server step and no folded form of it
        if self.privacy is not None or self.config.reducer != "mean" or per_update is None:
            return None
        return RoundFold(per_update)

    def aggregate_folded(
        self, global_params: Params, fold: RoundFold, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        return fold.mean.result() if global_params else {}

    def state(self) -> dict[str, Any]:
        return self.with_dp_state(self.weigh.state())

    def load_state(self, state: dict[str, Any]) -> None:
        self.weigh.load_state(self.load_dp_state(state))

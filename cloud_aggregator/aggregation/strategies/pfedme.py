"""pFedMe's server step (Dinh et al. 2020, Algorithm 1): ``w ← (1 − β)·w + β·mean(w_i)``.

The mean is FedAvg's (weighting and reducer as in :mod:`cloud_aggregator.aggregation.strategies.fedavg`);
``beta = 1`` is plain FedAvg and ``beta > 1`` the paper's extrapolation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cloud_aggregator.aggregation.strategies.base import register_strategy
from cloud_aggregator.aggregation.strategies.fedavg import FedAvg, FedAvgConfig
from cloud_aggregator.aggregation.streaming import RoundFold
from cloud_aggregator.aggregation.update import Update
from trainer_lite.params import Params


@dataclass(frozen=True)
class PFedMeServerConfig(FedAvgConfig):
    """FedAvg's settings plus β, the server's mixing weight (> 0)."""

    beta: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")


@register_strategy
class PFedMe(FedAvg):
    name = "pfedme"
    secagg = False  # its global moves by beta toward the mean: not the mean a masked sum gives
    config_cls = PFedMeServerConfig

    def aggregate(
        self, global_params: Params, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        return self._mix(global_params, super().aggregate(global_params, updates, round_=round_, phase=phase))

    def aggregate_folded(
        self, global_params: Params, fold: RoundFold, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        mean = super().aggregate_folded(global_params, fold, updates, round_=round_, phase=phase)
        return self._mix(global_params, mean)

    def _mix(self, global_params: Params, mean: Params) -> Params:
        beta = self.config.beta
        if beta == 1.0:
            return mean
        return {n: ((1.0 - beta) * global_params[n] + beta * mean[n]).astype(mean[n].dtype) for n in mean}

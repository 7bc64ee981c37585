"""FedAvg's server step: a weighted mean of the shared parameters.

Serves every algorithm whose server side is an average of what was uploaded:
FedAvg itself, PFL-DA and Simple-DA (the decoder w, §2.3: ``w = (1/N) Σ w_i``),
and local-only training (nothing shared: the mean of empty dicts is empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cloud_aggregator.aggregate import weighted_mean
from cloud_aggregator.strategies.base import Strategy, Update, register_strategy
from trainer_lite.params import Params


@dataclass(frozen=True)
class FedAvgConfig:
    """``weighting``: ``"samples"`` (McMahan et al.) or ``"uniform"`` (PFL-DA's p_i = 1/N)."""

    weighting: str = "samples"

    def __post_init__(self) -> None:
        if self.weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {self.weighting!r}")


@register_strategy("fedavg", "pflda", "simple_da", "indiv")
class FedAvg(Strategy):
    name = "fedavg"
    config_cls = FedAvgConfig

    def aggregate(
        self, global_params: Params, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        if not global_params:
            return {}
        uniform = self.config.weighting == "uniform"
        return weighted_mean([(u.params, 1.0 if uniform else float(u.n_samples)) for u in updates])

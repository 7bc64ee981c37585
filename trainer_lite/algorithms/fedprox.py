"""FedProx's client (Li et al. 2020): FedAvg's local steps on ``F_i(θ) + μ/2·‖θ − θ_t‖²``.

The proximal term keeps the local solution near the round's global ``θ_t``; the
server step is FedAvg's weighted mean.  ``mu = 0`` is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientResult, TrainConfig, register_client
from trainer_lite.algorithms.fedavg import FedAvgClient
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params


@dataclass(frozen=True)
class FedProxConfig(TrainConfig):
    """``mu`` is μ of the proximal term ``μ/2·‖θ − θ_t‖²`` (>= 0)."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu < 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")


@register_client
class FedProxClient(FedAvgClient):
    """Every parameter is shared; the local objective has the proximal term."""

    name = "fedprox"
    server = "fedavg"
    config_cls = FedProxConfig

    def update(
        self,
        shared: Params,
        local: Params,
        data: Dataset,
        *,
        rng: np.random.Generator,
        round_: int,
        phase: str,
    ) -> tuple[ClientResult, Params]:
        cfg = self.config
        anchor = {n: np.asarray(v) for n, v in shared.items()}
        params = copy_params(shared)

        def proximal(p: Params, grads: Params) -> None:
            for n in grads:
                grads[n] = grads[n] + cfg.mu * (p[n] - anchor[n])

        train_loss = self.local_steps(
            params, data, rng, round_=round_, grad_hook=proximal if cfg.mu else None
        )
        return ClientResult(params, len(data), {"train_loss": train_loss}), {}

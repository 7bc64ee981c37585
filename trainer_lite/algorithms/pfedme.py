"""pFedMe's client (Dinh, Tran & Nguyen 2020): personalization through Moreau envelopes.

Each of the ``local_steps`` local rounds on a batch first solves the personal
problem ``θ ≈ argmin F_i(θ) + λ/2·‖θ − w_i‖²`` approximately with
``inner_steps`` steps at ``personal_lr`` (starting from the round's ``θ``), then
moves the device's copy of the global model toward it,
``w_i ← w_i − η·λ·(w_i − θ)`` with ``η = lr``.  The device uploads ``w_i`` and
keeps ``θ`` (``personal.*``) to predict with; the server mixes with β
(``cloud_aggregator.aggregation.strategies.pfedme``).

As in the reference code, θ starts each round from the global model and the
inner solver's state lasts for the round; ``optimizer="sgd"`` (the default)
gives the paper's plain gradient steps.

Cold start: nothing to do.  θ starts every round from the downlinked global model,
so a device that joins a trained fleet personalizes the fleet's model from its first round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from trainer_lite.algorithms.base import ClientResult, TrainConfig, loss_and_grads, register_client
from trainer_lite.algorithms.fedavg import FedAvgClient
from trainer_lite.algorithms.pflda import PERSONAL, step_batches
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params, strip_prefix, with_prefix


@dataclass(frozen=True)
class PFedMeConfig(TrainConfig):
    """pFedMe's λ (``lam``), K (``inner_steps``) and personal learning rate; ``lr`` is η."""

    optimizer: str = "sgd"
    lr: float = 0.01
    lam: float = 15.0
    inner_steps: int = 5
    personal_lr: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lam <= 0 or self.personal_lr <= 0 or self.inner_steps < 1:
            raise ValueError(
                f"need lam > 0, personal_lr > 0 and inner_steps >= 1, got "
                f"{self.lam}, {self.personal_lr}, {self.inner_steps}"
            )


@register_client
class PFedMeClient(FedAvgClient):
    """Uploads its copy of the global model; keeps the personalized θ."""

    name = "pfedme"
    server = "pfedme"
    config_cls = PFedMeConfig

    def personal_params(self, shared: Params, local: Params) -> Params:
        personal = strip_prefix(local, PERSONAL)
        return personal if personal else dict(shared)

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
        w = copy_params(shared)
        theta = copy_params(shared)
        inner = replace(cfg, lr=cfg.personal_lr).make_optimizer(round_)
        eta = cfg.lr_at(round_)
        total = 0.0
        for _, batch in step_batches(data, cfg.batch_size, cfg.local_steps, rng):
            for _ in range(cfg.inner_steps):
                value, g = loss_and_grads(self.model, theta, batch, self.loss)
                inner.step(theta, {n: g[n] + cfg.lam * (theta[n] - w[n]) for n in theta})
            total += value
            for n in w:
                w[n] = w[n] - eta * cfg.lam * (w[n] - theta[n])
        result = ClientResult(w, len(data), {"train_loss": total / cfg.local_steps})
        return result, with_prefix(theta, PERSONAL)

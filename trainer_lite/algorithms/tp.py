"""Train-then-personalize (TP; Yu, Bagdasaryan & Shmatikov 2020): FedAvg, then local fine-tuning.

Each round a device runs FedAvg's local steps from the global ``w^t`` and uploads
the result.  From round ``finetune_from`` on it also fine-tunes a fresh copy of
``w^t`` for ``finetune_steps`` steps (a fresh optimizer at ``finetune_lr``) and
keeps that as its personal model (local state ``personal.*``, never uploaded).
So the personal model is always "the latest global the device was sent,
fine-tuned on its own data" — the eval-time fine-tune of the TP baseline, kept on
the device so it can predict between rounds.  Before ``finetune_from`` the device
predicts with the global model itself.

Cold start: nothing to do: the personal model is re-derived from the downlinked global
every round.  ``finetune_from`` counts the fleet's rounds (the global must have trained
first), and a device that joins a trained fleet fine-tunes from its first round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientResult, TrainConfig, register_client
from trainer_lite.algorithms.fedavg import FedAvgClient
from trainer_lite.algorithms.pflda import PERSONAL
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params, strip_prefix, with_prefix


@dataclass(frozen=True)
class TPConfig(TrainConfig):
    """FedAvg's settings plus the fine-tune: ``finetune_steps``, ``finetune_lr`` (``None``: ``lr``), ``finetune_from``."""

    finetune_steps: int = 10
    finetune_lr: float | None = None
    finetune_from: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.finetune_steps < 1 or self.finetune_from < 1:
            raise ValueError(
                f"finetune_steps and finetune_from must be >= 1, got {self.finetune_steps}, {self.finetune_from}"
            )
        if self.finetune_lr is not None and self.finetune_lr <= 0:
            raise ValueError(f"finetune_lr must be > 0, got {self.finetune_lr}")


@register_client
class TPClient(FedAvgClient):
    """FedAvg client that also keeps a fine-tuned copy of the global model as its personal model."""

    name = "tp"
    server = "fedavg"
    config_cls = TPConfig

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
        result, _ = super().update(shared, local, data, rng=rng, round_=round_, phase=phase)
        cfg = self.config
        if round_ < cfg.finetune_from:
            return result, {}
        tuned = copy_params(shared)
        loss = self.local_steps(tuned, data, rng, round_=round_, steps=cfg.finetune_steps, lr=cfg.finetune_lr)
        metrics = {**result.metrics, "finetune_loss": loss}
        return ClientResult(result.shared, result.n_samples, metrics), with_prefix(tuned, PERSONAL)

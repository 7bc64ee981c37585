"""FedRep (Collins et al. 2021): a shared body (representation), a personal head, trained in turn.

Each round a device first runs ``head_steps`` (τ_h) steps on its personal head
with the downlinked body frozen, then ``local_steps`` (τ_φ) steps on the body
with the new head frozen; it uploads the body and keeps the head.  Which blocks
form the head is ``personal_blocks`` (by default the model's last block with
parameters), as in FedPer (:mod:`trainer_lite.algorithms.fedper`), whose split
this reuses; the server is FedAvg over the body.

Cold start: FedPer's (:mod:`trainer_lite.algorithms.fedper`): the personal blocks are
fitted to the first rows through the frozen downlinked shared blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientResult, register_client
from trainer_lite.algorithms.fedper import PartialSharingClient, PartialSharingConfig
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params


@dataclass(frozen=True)
class FedRepConfig(PartialSharingConfig):
    """FedPer's split plus τ_h: ``head_steps`` and ``head_lr`` (``None``: ``lr``); ``local_steps`` is τ_φ."""

    head_steps: int = 10
    head_lr: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_steps < 1:
            raise ValueError(f"head_steps must be >= 1, got {self.head_steps}")
        if self.head_lr is not None and self.head_lr <= 0:
            raise ValueError(f"head_lr must be > 0, got {self.head_lr}")


@register_client
class FedRepClient(PartialSharingClient):
    """Head steps then body steps; upload the body, keep the head."""

    name = "fedrep"
    server = "fedavg"
    config_cls = FedRepConfig

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
        params = copy_params(self.personal_params(shared, local))
        head_names, body_names = self.personal_names(), self.shared_names()
        head_loss = self.local_steps(
            params, data, rng, round_=round_, trainable=head_names, steps=cfg.head_steps, lr=cfg.head_lr
        )
        body_loss = self.local_steps(params, data, rng, round_=round_, trainable=body_names)
        uploaded = {n: params[n] for n in body_names}
        kept = {n: params[n] for n in head_names}
        metrics = {"train_loss": body_loss, "head_loss": head_loss}
        return ClientResult(uploaded, len(data), metrics), kept

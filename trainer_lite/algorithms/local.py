"""Local-only training ("indiv" in PFL-DA's tables): nothing is shared, each device alone."""

from __future__ import annotations

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult, TrainConfig, register_client
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params


@register_client
class LocalClient(ClientAlgorithm):
    """All parameters are local; the device uploads an empty dict and its sample count."""

    name = "indiv"
    server = "fedavg"
    config_cls = TrainConfig

    def shared_names(self) -> list[str]:
        return []

    def init_local(self, rng: np.random.Generator) -> Params:
        return self.model.init(rng)

    def personal_params(self, shared: Params, local: Params) -> Params:
        return dict(local)

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
        params = copy_params(local)
        train_loss = self.local_steps(params, data, rng, round_=round_)
        return ClientResult({}, len(data), {"train_loss": train_loss}), params

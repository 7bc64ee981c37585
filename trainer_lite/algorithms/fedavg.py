"""FedAvg's client (McMahan et al. 2017): train every parameter locally, upload all of it.

Metrics: ``train_loss`` is the mean minibatch loss over the local steps;
``train_loss_start`` is the downlinked global model's loss on all of the device's
training rows, before any local step -- ``F_i(w)`` at the round's ``w``, which
group-fair weightings (:class:`cloud_aggregator.aggregation.weighting.GifairWeighting`) rank by.
"""

from __future__ import annotations

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult, TrainConfig, register_client
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params


@register_client
class FedAvgClient(ClientAlgorithm):
    """Every parameter is shared; the client keeps nothing between rounds."""

    name = "fedavg"
    server = "fedavg"
    config_cls = TrainConfig

    def shared_names(self) -> list[str]:
        return sorted(self.model.init(np.random.default_rng(0)))

    def init_local(self, rng: np.random.Generator) -> Params:
        return {}

    def personal_params(self, shared: Params, local: Params) -> Params:
        return dict(shared)

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
        params = copy_params(shared)
        # F_i(w): the downlinked model on the training rows (one forward pass, no rng drawn).
        start_value, _ = self.loss(self.model(params, data.x), data.y)
        train_loss = self.local_steps(params, data, rng, round_=round_)
        metrics = {"train_loss": train_loss, "train_loss_start": float(start_value)}
        return ClientResult(params, len(data), metrics), {}

"""FedAvg's client (McMahan et al. 2017): train every parameter locally, upload all of it.

Also the local solver that other algorithms reuse (``run_local_steps``).

Metrics: ``train_loss`` is the mean minibatch loss over the local steps;
``train_loss_start`` is the downlinked global model's loss on all of the device's
training rows, before any local step -- ``F_i(w)`` at the round's ``w``, which
group-fair weightings (:class:`cloud_aggregator.weighting.GifairWeighting`) rank by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from trainer_lite.algorithms.base import (
    ClientAlgorithm,
    ClientResult,
    LossFn,
    TrainConfig,
    loss_and_grads,
    register_client,
)
from trainer_lite.data import Dataset, minibatches
from trainer_lite.layers import Sequential
from trainer_lite.optim import Optimizer
from trainer_lite.params import Params, copy_params

GradHook = Callable[[Params, Params], None]


def run_local_steps(
    model: Sequential,
    params: Params,
    trainable: Iterable[str],
    data: Dataset,
    loss: LossFn,
    optimizer: Optimizer,
    steps: int,
    batch_size: int | None,
    rng: np.random.Generator,
    grad_hook: GradHook | None = None,
) -> float:
    """``steps`` optimizer steps on ``trainable`` names of ``params`` (updated in place).

    Minibatches cycle through seeded epochs; ``grad_hook(params, grads)`` may add
    regularisation gradients in place before each step.  Returns the mean loss.
    """
    names = list(trainable)
    total, done = 0.0, 0
    while done < steps:
        for batch in minibatches(data, batch_size, rng):
            value, grads = loss_and_grads(model, params, batch, loss)
            grads = {n: grads[n] for n in names}
            if grad_hook is not None:
                grad_hook(params, grads)
            optimizer.step(params, grads)
            total += value
            done += 1
            if done == steps:
                break
    return total / steps


@register_client
class FedAvgClient(ClientAlgorithm):
    """Every parameter is shared; the client keeps nothing between rounds."""

    name = "fedavg"
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
        cfg = self.config
        # F_i(w): the downlinked model on the training rows (one forward pass, no rng drawn).
        start_value, _ = self.loss(self.model(params, data.x), data.y)
        train_loss = run_local_steps(
            self.model,
            params,
            params,
            data,
            self.loss,
            cfg.make_optimizer(round_),
            cfg.local_steps,
            cfg.batch_size,
            rng,
        )
        metrics = {"train_loss": train_loss, "train_loss_start": float(start_value)}
        return ClientResult(params, len(data), metrics), {}

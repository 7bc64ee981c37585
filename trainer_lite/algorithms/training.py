"""Local optimisation: the losses by name, the optimizer settings, and the minibatch steps.

What every algorithm's :meth:`~trainer_lite.algorithms.base.ClientAlgorithm.local_steps` runs;
:mod:`trainer_lite.algorithms.base` imports these names, so they can be imported from there too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from trainer_lite import losses
from trainer_lite.data import Dataset, minibatches
from trainer_lite.layers import Sequential
from trainer_lite.optim import SGD, Adam, Optimizer
from trainer_lite.params import Params

LossFn = Callable[[np.ndarray, np.ndarray], tuple[float, np.ndarray]]
#: ``grad_hook(params, grads)``: adds regularisation gradients to ``grads`` in place.
GradHook = Callable[[Params, Params], None]
# Every built-in loss also takes keyword-only ``sample_weights`` (see trainer_lite.losses).
_LOSSES: dict[str, LossFn] = {
    "mse": losses.mse,
    "cross_entropy": losses.cross_entropy,
    "bce": losses.bce_with_logits,
}


def get_loss(name: str) -> LossFn:
    """The loss registered under ``name``; the error lists the valid names."""
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(_LOSSES)}") from None


def register_loss(name: str, fn: LossFn) -> None:
    """Add (or replace) ``fn(pred, target) -> (value, d value / d pred)`` under ``name``."""
    _LOSSES[name] = fn


@dataclass(frozen=True)
class TrainConfig:
    """Local optimisation settings shared by most algorithms.

    The learning rate of round ``r`` (1-based) is ``lr * lr_decay ** (r // lr_decay_every)``
    (the PFL-DA authors' schedule: × 0.99 every 5 rounds).  ``r`` is the *device's own*
    round, the rounds it has taken part in (:func:`trainer_lite.client.participate`), so a
    device that joins a trained fleet starts at ``lr`` as a fresh fleet does; for a
    device that took part in every round it equals the fleet's round.
    """

    optimizer: str = "adam"
    lr: float = 3e-3
    weight_decay: float = 0.0
    momentum: float = 0.0
    local_steps: int = 10
    batch_size: int | None = None
    lr_decay: float = 1.0
    lr_decay_every: int = 1
    loss: str = "mse"

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.local_steps < 1 or self.lr_decay_every < 1:
            raise ValueError("local_steps and lr_decay_every must be >= 1")
        get_loss(self.loss)

    def lr_at(self, round_: int) -> float:
        return self.lr * self.lr_decay ** (round_ // self.lr_decay_every)

    def make_optimizer(self, round_: int) -> Optimizer:
        lr = self.lr_at(round_)
        if self.optimizer == "adam":
            return Adam(lr=lr, weight_decay=self.weight_decay)
        return SGD(lr=lr, momentum=self.momentum, weight_decay=self.weight_decay)


def loss_and_grads(model: Sequential, params: Params, data: Dataset, loss: LossFn) -> tuple[float, Params]:
    """Loss of ``model`` on ``data`` and its gradient for every parameter."""
    pred, cache = model.forward(params, data.x)
    value, dpred = loss(pred, data.y)
    # param_grads skips the input gradient nobody uses (the widest GEMM of an MLP).
    return value, model.param_grads(params, cache, dpred)


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
    regularisation gradients in place before each step.  Algorithms call
    :meth:`ClientAlgorithm.local_steps`, which fills these arguments from the
    algorithm's model, loss and config.

    Returns
    -------
    float
        The mean minibatch loss over the steps.
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


def score(loss: LossFn, pred: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """``{"loss": ...}`` of predictions, plus ``"accuracy"`` for class-id targets."""
    value, _ = loss(pred, y)
    out = {"loss": value}
    if y.ndim == 1 and y.dtype.kind in "iu" and pred.ndim == 2 and pred.shape[1] > 1:
        out["accuracy"] = float(np.mean(np.argmax(pred, axis=1) == y))
    return out

"""The non-federated references of FTL-TP's comparison (§5.2): IL, CL and CTL, run in one process.

* **IL** (individual learning): each device trains alone on its own data.
* **CL** (centralised learning): one model on the pooled data of a group's devices,
  the privacy-free upper reference.
* **CTL** (centralised transfer learning): train on one task group's pooled data,
  copy the first K_B blocks into the other group's model, freeze them, and
  fine-tune the rest on that group's pooled data.

All three are plain minibatch training for a number of epochs with one optimiser
throughout (as ``model.fit`` would), using the same loss machinery as the
federated algorithms.  None of this runs on a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from trainer_lite.algorithms.base import LossFn
from trainer_lite.algorithms.fedl2r import split_after, train_l2r
from trainer_lite.data import Dataset
from trainer_lite.layers import Sequential
from trainer_lite.optim import Adam
from trainer_lite.params import Params, copy_params


def train_centralised(
    model: Sequential,
    params: Params,
    data: Dataset,
    loss: LossFn,
    *,
    epochs: int,
    batch_size: int | None,
    lr: float,
    rng: np.random.Generator,
    trainable: Sequence[str] | None = None,
    alpha_l2r: float = 0.0,
    l2r_layers: int = 1,
) -> tuple[Params, dict[str, float]]:
    """``epochs`` passes of minibatch Adam over ``data``; returns new parameters and the last epoch's loss.

    Parameters
    ----------
    model, params
        The model and its starting parameters (not mutated).
    trainable
        Names to update (default: all); the rest stay frozen.
    alpha_l2r, l2r_layers
        Optional ``α·mean‖z‖²`` on the output of the first ``l2r_layers`` blocks.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    out = copy_params(params)
    names = sorted(out) if trainable is None else sorted(trainable)
    missing = sorted(set(names) - set(out))
    if missing:
        raise ValueError(f"trainable names {missing} are not parameters of the model; have {sorted(out)}")
    base, head = split_after(model, l2r_layers)
    opt = Adam(lr=lr)
    per_epoch = 1 if batch_size is None else -(-len(data) // batch_size)
    metrics: dict[str, float] = {}
    for _ in range(epochs):
        metrics = train_l2r(
            base, head, out, names, data, loss, opt, per_epoch, batch_size, rng, alpha=alpha_l2r
        )
    return out, metrics


def transfer_base(source: Params, target: Params, base_names: Sequence[str]) -> Params:
    """``target`` with its base blocks replaced by copies of ``source``'s (shapes must match)."""
    out = copy_params(target)
    for n in base_names:
        if source[n].shape != target[n].shape:
            raise ValueError(
                f"base {n!r} has shape {source[n].shape} in the source, {target[n].shape} in the target"
            )
        out[n] = np.array(source[n], copy=True)
    return out


class TransferResult(NamedTuple):
    """CTL's two models: the source group's, and the target group's on the source's frozen base."""

    source: Params
    target: Params


def _shared_base(source_model: Sequential, target_model: Sequential, base_layers: int) -> list[str]:
    """The parameter names of the first ``base_layers`` blocks, which both models must share."""
    src_base, _ = split_after(source_model, base_layers)
    tgt_base, _ = split_after(target_model, base_layers)
    base_names = src_base.param_names()
    if base_names != tgt_base.param_names():
        raise ValueError(
            f"source and target bases differ: {base_names} vs {tgt_base.param_names()}; use models "
            "that agree up to the last width"
        )
    return base_names


def centralised_transfer(
    source_model: Sequential,
    target_model: Sequential,
    source_data: Dataset,
    target_data: Dataset,
    loss: LossFn,
    *,
    base_layers: int,
    epochs: int,
    batch_size: int | None,
    lr: float,
    rng: np.random.Generator,
    finetune_epochs: int | None = None,
) -> TransferResult:
    """CTL: train ``source_model`` on ``source_data``, freeze its first ``base_layers`` blocks
    in a fresh ``target_model``, fine-tune the blocks above on ``target_data``.

    The target's base equals the trained source's bit for bit.
    """
    base_names = _shared_base(source_model, target_model, base_layers)
    dtype = source_data.x.dtype
    src_params, _ = train_centralised(
        source_model,
        source_model.init(rng, dtype=dtype),
        source_data,
        loss,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        rng=rng,
    )
    start = transfer_base(src_params, target_model.init(rng, dtype=dtype), base_names)
    frozen = set(base_names)
    tuned, _ = train_centralised(
        target_model,
        start,
        target_data,
        loss,
        epochs=epochs if finetune_epochs is None else finetune_epochs,
        batch_size=batch_size,
        lr=lr,
        rng=rng,
        trainable=[n for n in start if n not in frozen],
    )
    return TransferResult(src_params, tuned)

"""FedL2R / FedSR's L2 representation regulariser (Nguyen et al. 2022), and its local solver.

The local objective is ``F_k(θ) + α·(1/n)·Σ_n ‖z_n‖² (+ μ/2·‖θ − θ_t‖²)``, where
``z_n`` is the representation of sample ``n``: the output of the first ``k`` blocks
with parameters of the model *after* their activation (a Keras ``Dense(...,
activation="relu")`` layer's output).  Limiting the representation's norm limits its
information content, which is FedSR's domain-generalisation argument.

:func:`split_after` cuts a ``Sequential`` into that base and the head above it;
:func:`l2r_loss_and_grads` back-propagates the classification loss through the head
and adds the regulariser's gradient ``2α·z/n`` where the head hands its gradient to
the base; :func:`train_l2r` runs Adam steps on it.  FTL-TP
(:mod:`trainer_lite.algorithms.ftltp`) reuses all three on its shared base layers.

The FedL2R client shares every parameter (the server step is FedAvg's weighted
mean).  Its representation defaults to the penultimate block's output, FedSR's
"featurizer" that feeds the classifier.

Where z sits matters far more than α
------------------------------------
FTL-TP puts the term on its shared base, the *first* block (K_B = 1: 175 units fed by
the 624 standardised features); FedL2R here on the *penultimate* (50 units, three
blocks deep).  The gradient is the same code for both and matches torch (tests), but
the effect differs: once the source data are fitted (training CE ≈ 0, easy with
≈ 600 rows in 624 dimensions), the L2R gradient is the only consistent one left on
the first block, and Adam's per-coordinate normalisation gives it steps of ≈ η
whatever α is (α = 1e-5 still halves mean‖z‖² on the simulated welds).
The first block then learns to silence the *source* rows' subspace only: rows of an
unseen domain, off that subspace, keep (or grow) their activity, so the head sees
inputs far larger than any it was trained on.  On the penultimate block the head
above simply rescales.  ``benchmarks/ftltp_welding.py`` reports mean‖z‖² of the
final base on source and target rows.

FedSR's public code (``src/methods/FedL2R.py``) differs from eq. 4 in three ways we
do not copy: it penalises ``‖z_n‖`` (not squared), its z is the linear featurizer
output (no ReLU), and each client keeps one optimiser across rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from trainer_lite.algorithms.base import ClientResult, LossFn, TrainConfig, register_client
from trainer_lite.algorithms.fedavg import FedAvgClient
from trainer_lite.data import Dataset, minibatches
from trainer_lite.layers import Sequential
from trainer_lite.optim import Optimizer
from trainer_lite.params import Params, copy_params
from trainer_lite.task import TaskSpec


def split_after(model: Sequential, k: int) -> tuple[Sequential, Sequential]:
    """``(base, head)``: the first ``k`` blocks with parameters (and the parameter-free blocks after them).

    Both halves keep the model's block names, so they read the same ``Params`` dict.
    For ``mlp([624, 175, 125, 50, C])`` and ``k=1`` the base is ``fc0, relu0``.
    """
    with_params = [i for i, (_, layer) in enumerate(model.layers) if layer.param_names()]
    if not 1 <= k < len(with_params):
        raise ValueError(
            f"the base must hold between 1 and {len(with_params) - 1} of the model's "
            f"{len(with_params)} blocks with parameters (a head must remain), got {k}"
        )
    cut = with_params[k]
    return Sequential(model.layers[:cut]), Sequential(model.layers[cut:])


class L2RLoss(NamedTuple):
    """One minibatch's loss parts and the gradient of their sum."""

    task: float  # the classification loss F_k
    l2r: float  # α·mean‖z‖²
    grads: Params
    z_sq: float  # mean‖z‖², reported whatever α (how large the representation is)


def l2r_loss_and_grads(
    base: Sequential,
    head: Sequential,
    params: Params,
    data: Dataset,
    loss: LossFn,
    alpha: float,
    *,
    base_grads: bool = True,
) -> L2RLoss:
    """``loss(head(base(x)), y) + α·mean_n ‖base(x)_n‖²`` and its gradient for every parameter.

    ``base_grads=False`` skips the base's gradients (a frozen base, as in CTL's fine-tuning).
    """
    z, base_cache = base.forward(params, data.x)
    pred, head_cache = head.forward(params, z)
    task, dpred = loss(pred, data.y)
    grads, dz = head.backward(params, head_cache, dpred)
    z_sq = float(np.vdot(z, z)) / len(z)
    if alpha:
        dz = dz + (2.0 * alpha / len(z)) * z
    if base_grads:
        grads.update(base.param_grads(params, base_cache, dz))
    return L2RLoss(task, alpha * z_sq, grads, z_sq)


def local_steps_for(n_samples: int, batch_size: int | None, epochs: int | None, local_steps: int) -> int:
    """``epochs·⌈n/B⌉`` when ``epochs`` is set (the papers' E), else ``local_steps``."""
    if epochs is None:
        return local_steps
    per_epoch = 1 if batch_size is None else math.ceil(n_samples / batch_size)
    return epochs * max(1, per_epoch)


def train_l2r(
    base: Sequential,
    head: Sequential,
    params: Params,
    trainable: list[str],
    data: Dataset,
    loss: LossFn,
    optimizer: Optimizer,
    steps: int,
    batch_size: int | None,
    rng: np.random.Generator,
    *,
    alpha: float = 0.0,
    mu: float = 0.0,
    anchor: Params | None = None,
) -> dict[str, float]:
    """``steps`` optimizer steps on ``trainable`` names of ``params`` (in place).

    The objective is the task loss, ``alpha``·mean‖z‖² on the base output, and, when
    ``mu > 0``, FedProx's ``μ/2·‖θ − anchor‖²`` over the trainable names.  Returns the
    means over the steps of the task loss, the regulariser and mean‖z‖².
    """
    if mu and anchor is None:
        raise ValueError("a proximal term (mu > 0) needs the anchor θ_t it pulls towards")
    task_sum = reg_sum = z_sum = 0.0
    done = 0
    # μ(θ − θ_t) is formed in reused buffers and added in place to the freshly computed
    # gradients: three temporaries per parameter per step would cost as much as Adam.
    scratch = {n: np.empty_like(params[n]) for n in trainable} if mu else {}
    base_grads = not set(base.param_names()).isdisjoint(trainable)
    while done < steps:
        for batch in minibatches(data, batch_size, rng):
            out = l2r_loss_and_grads(base, head, params, batch, loss, alpha, base_grads=base_grads)
            grads = {n: out.grads[n] for n in trainable}
            if mu:
                for n in trainable:
                    pull = np.subtract(params[n], anchor[n], out=scratch[n])
                    pull *= mu
                    grads[n] += pull
            optimizer.step(params, grads)
            task_sum += out.task
            reg_sum += out.l2r
            z_sum += out.z_sq
            done += 1
            if done == steps:
                break
    return {"train_loss": task_sum / steps, "l2r": reg_sum / steps, "z_sq": z_sum / steps}


def l2r_round(
    base: Sequential,
    head: Sequential,
    params: Params,
    data: Dataset,
    loss: LossFn,
    cfg: FedL2RConfig,
    rng: np.random.Generator,
    *,
    round_: int,
    anchor: Params,
) -> dict[str, float]:
    """One round of :func:`train_l2r` on every name of ``params``, as ``cfg`` sets it.

    ``cfg``'s optimizer for ``round_``, its steps (:func:`local_steps_for`) and batch size, its
    ``alpha_l2r`` and ``mu`` (pulling towards ``anchor``); ``cfg`` is any config with those fields
    (FedL2R's, FTL-TP's).
    """
    return train_l2r(
        base,
        head,
        params,
        sorted(params),
        data,
        loss,
        cfg.make_optimizer(round_),
        local_steps_for(len(data), cfg.batch_size, cfg.epochs, cfg.local_steps),
        cfg.batch_size,
        rng,
        alpha=cfg.alpha_l2r,
        mu=cfg.mu,
        anchor=anchor,
    )


@dataclass(frozen=True)
class FedL2RConfig(TrainConfig):
    """FedAvg's settings plus the regulariser.

    Attributes
    ----------
    alpha_l2r
        α of ``α·mean‖z‖²`` (FTL-TP's FedL2R baseline: 0.01).
    l2r_layers
        The representation is the output of this many blocks with parameters
        (``None``: all but the last, FedSR's featurizer).
    mu
        Optional FedProx term (0: none).
    epochs
        Local epochs E; when set, a device runs ``E·⌈n/B⌉`` steps instead of ``local_steps``.
    """

    alpha_l2r: float = 0.01
    l2r_layers: int | None = None
    mu: float = 0.0
    epochs: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alpha_l2r < 0 or self.mu < 0:
            raise ValueError(f"alpha_l2r and mu must be >= 0, got {self.alpha_l2r}, {self.mu}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {self.epochs}")


@register_client
class FedL2RClient(FedAvgClient):
    """Every parameter is shared; the local loss adds ``α·mean‖z‖²`` on the representation."""

    name = "fedl2r"
    server = "fedavg"
    config_cls = FedL2RConfig

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__(spec)
        n_blocks = sum(1 for _, layer in self.model.layers if layer.param_names())
        k = self.config.l2r_layers if self.config.l2r_layers is not None else n_blocks - 1
        self.base, self.head = split_after(self.model, k)

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
        params = copy_params(shared)
        metrics = l2r_round(
            self.base, self.head, params, data, self.loss, cfg, rng, round_=round_, anchor=shared
        )
        return ClientResult(params, len(data), metrics), {}

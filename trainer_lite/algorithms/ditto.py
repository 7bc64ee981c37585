"""Ditto (Li et al. 2021): a FedAvg global model plus a personal model kept near it.

Each round a device trains a copy of the global model ``w`` on its data (that copy
is uploaded; the server averages, as FedAvg) and its personal model ``v`` (local
state ``personal.*``, never uploaded), which it predicts with.

Two ways to keep ``v`` near ``w`` (``pull``):

``"gradient"``
    The paper's objective ``F_i(v) + λ/2·‖v − w^t‖²``: the gradient ``λ(v − w^t)``
    is added at each personal step.
``"convex"``
    The PFL-DA authors' Ditto baseline (``printer.py``, ``sineregression.py``):
    after an inner step, ``v ← λ·w^t + (1 − λ)·v`` on the blocks named in
    ``personal_pull`` (their code: the decoder only, λ = 0.9), and the device's
    *copy of the global model* is pulled back the same way on the blocks in
    ``global_pull`` (their code: the encoder).  Their code pulls that copy of the
    global encoder, not the personal encoder, so the personal encoder is free and
    the global encoder barely moves; we reproduce it as written.

As in the authors' code, both optimizers are fresh every round, and both models
take their inner steps interleaved on the same batches.

Cold start (a device that joins a trained fleet): the personal model ``v`` starts
as the downlinked global model ``w`` instead of a random draw.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from trainer_lite.algorithms.base import (
    ClientAlgorithm,
    ClientResult,
    TrainConfig,
    loss_and_grads,
    register_client,
)
from trainer_lite.algorithms.pflda import PERSONAL, centered_loss_and_grads, step_batches
from trainer_lite.data import Dataset
from trainer_lite.optim import Optimizer
from trainer_lite.params import Params, copy_params, strip_prefix, with_prefix


@dataclass(frozen=True)
class DittoConfig(TrainConfig):
    """Ditto's client settings.

    Parameters
    ----------
    lam
        ``pull="gradient"``: λ of ``λ/2·‖v − w‖²`` (>= 0).  ``pull="convex"``: the
        weight of ``w`` in ``v ← λ·w + (1 − λ)·v`` (in [0, 1]).
    pull
        ``"gradient"`` (the paper) or ``"convex"`` (the PFL-DA authors' baseline).
    pull_at
        Convex pulls after ``"every"`` inner step or only the ``"first"`` of a round.
    personal_pull
        Blocks of ``v`` pulled toward ``w``; ``None`` pulls every parameter.
    global_pull
        Blocks of the device's copy of ``w`` pulled back toward ``w^t`` (convex only).
    global_optimizer
        Optimizer of the global copy (``"adam"``/``"sgd"``); ``None`` uses
        ``optimizer``.  The authors' sine study trains it with SGD.
    feature_center, encoder_block
        The authors' feature-centring term on the global copy's loss (see
        :mod:`trainer_lite.algorithms.pflda`).
    """

    lam: float = 1.0
    pull: str = "gradient"
    pull_at: str = "every"
    personal_pull: tuple[str, ...] | None = None
    global_pull: tuple[str, ...] = ()
    global_optimizer: str | None = None
    feature_center: float = 0.0
    encoder_block: str = "encoder"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pull not in ("convex", "gradient"):
            raise ValueError(f"pull must be 'convex' or 'gradient', got {self.pull!r}")
        if self.pull_at not in ("every", "first"):
            raise ValueError(f"pull_at must be 'every' or 'first', got {self.pull_at!r}")
        if self.lam < 0 or (self.pull == "convex" and self.lam > 1):
            raise ValueError(f"lam must be >= 0 (and <= 1 for the convex pull), got {self.lam}")
        if self.pull == "gradient" and self.global_pull:
            raise ValueError(
                "global_pull is the authors' convex-pull quirk; leave it empty with pull='gradient'"
            )
        if self.global_optimizer not in (None, "adam", "sgd"):
            raise ValueError(f"global_optimizer must be None, 'adam' or 'sgd', got {self.global_optimizer!r}")
        if self.feature_center < 0:
            raise ValueError(f"feature_center must be >= 0, got {self.feature_center}")


@register_client
class DittoClient(ClientAlgorithm):
    """Ditto's client: uploads its trained copy of the global model, keeps ``v`` at home."""

    name = "ditto"
    server = "fedavg"
    config_cls = DittoConfig

    def shared_names(self) -> list[str]:
        return sorted(self.model.param_names())

    def _block_names(self, blocks: tuple[str, ...] | list[str] | None) -> list[str]:
        if blocks is None:
            return self.shared_names()
        return sorted(n for b in blocks for n in self.model.names(b))

    def init_local(self, rng: np.random.Generator) -> Params:
        return with_prefix(self.model.init(rng), PERSONAL)

    def cold_start(
        self, shared: Params, local: Params, data: Dataset, *, rng: np.random.Generator, phase: str
    ) -> Params:
        """``v`` starts as the downlinked global model (module docstring)."""
        return with_prefix(copy_params({n: np.asarray(shared[n]) for n in self.shared_names()}), PERSONAL)

    def personal_params(self, shared: Params, local: Params) -> Params:
        return strip_prefix(local, PERSONAL)

    def _global_optimizer(self, round_: int) -> Optimizer:
        cfg = self.config
        if cfg.global_optimizer is None or cfg.global_optimizer == cfg.optimizer:
            return cfg.make_optimizer(round_)
        return replace(cfg, optimizer=cfg.global_optimizer).make_optimizer(round_)

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
        names = self.shared_names()
        w_start = {n: np.asarray(shared[n]) for n in names}
        glob = copy_params(w_start)
        v = copy_params(strip_prefix(local, PERSONAL))
        pulled = self._block_names(cfg.personal_pull)
        glob_pulled = self._block_names(cfg.global_pull)
        opt_g, opt_v = self._global_optimizer(round_), cfg.make_optimizer(round_)
        lam, total = cfg.lam, 0.0
        for step, batch in step_batches(data, cfg.batch_size, cfg.local_steps, rng):
            value, grads = centered_loss_and_grads(
                self.model, glob, batch, self.loss, cfg.feature_center, cfg.encoder_block
            )
            opt_g.step(glob, grads)
            total += value
            _, gv = loss_and_grads(self.model, v, batch, self.loss)
            if cfg.pull == "gradient":
                for n in pulled:
                    gv[n] = gv[n] + lam * (v[n] - w_start[n])
            opt_v.step(v, gv)
            if cfg.pull == "convex" and (cfg.pull_at == "every" or step == 0):
                for n in pulled:
                    v[n] = lam * w_start[n] + (1.0 - lam) * v[n]
                for n in glob_pulled:
                    glob[n] = lam * w_start[n] + (1.0 - lam) * glob[n]
        result = ClientResult(glob, len(data), {"train_loss": total / cfg.local_steps})
        return result, with_prefix(v, PERSONAL)

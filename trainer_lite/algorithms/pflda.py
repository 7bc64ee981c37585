"""PFL-DA and Simple-DA (Shi & Al Kontar 2023, seed 000, Algorithms 1-3).

The model is ``g(Φ_β(x))``: a personal encoder ``β`` (block ``encoder``), a shared
decoder ``w`` (block ``decoder``, the only thing uploaded) and a personal decoder
``γ`` kept near ``w``.  Local state holds ``encoder.*`` (β) and ``personal.decoder.*`` (γ).

Two ways to keep γ near w (``pull``):

``"gradient"``
    The paper as written: Algorithm 2 runs E steps on ``(w, β)`` of ``F_i``, then
    Algorithm 3 runs E steps on γ of ``F_i(γ, β^t) + λ1·‖γ − w^t‖²`` with the
    round's starting ``β^t`` and ``w^t``.
``"convex"`` (default; what the reproduction of Table 5 uses)
    The authors' public code: after each of the E inner steps on ``(w, β)``, one
    step on γ with the updated encoder, then ``γ ← λ1·w^t + (1 − λ1)·γ``
    (λ1 = 0.9 in the printer study).

Simple-DA (eq. 1) is the special case ``γ = w``: ``simple_da`` with λ1 = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import (
    ClientAlgorithm,
    ClientResult,
    TrainConfig,
    loss_and_grads,
    register_client,
)
from trainer_lite.algorithms.fedavg import run_local_steps
from trainer_lite.data import Dataset, minibatches
from trainer_lite.params import Params, copy_params, strip_prefix, with_prefix

PERSONAL = "personal"


@dataclass(frozen=True)
class PFLDAConfig(TrainConfig):
    """``lam`` is λ1; ``pull`` is ``"convex"`` (authors' code) or ``"gradient"`` (the paper)."""

    lam: float = 0.9
    pull: str = "convex"
    encoder_block: str = "encoder"
    decoder_block: str = "decoder"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pull not in ("convex", "gradient"):
            raise ValueError(f"pull must be 'convex' or 'gradient', got {self.pull!r}")
        if self.lam < 0 or (self.pull == "convex" and self.lam > 1):
            raise ValueError(f"lam must be >= 0 (and <= 1 for the convex pull), got {self.lam}")


@register_client
class PFLDAClient(ClientAlgorithm):
    """PFL-DA's client: Algorithm 2 (local_update) and Algorithm 3 (local_update_regularized)."""

    name = "pflda"
    config_cls = PFLDAConfig

    def _block_names(self, block: str) -> list[str]:
        return sorted(self.model.names(block))

    def shared_names(self) -> list[str]:
        return self._block_names(self.config.decoder_block)

    def init_local(self, rng: np.random.Generator) -> Params:
        full = self.model.init(rng)
        enc = {n: full[n] for n in self._block_names(self.config.encoder_block)}
        dec = {n: full[n] for n in self.shared_names()}
        return {**enc, **with_prefix(dec, PERSONAL)}

    def personal_params(self, shared: Params, local: Params) -> Params:
        enc = {n: local[n] for n in self._block_names(self.config.encoder_block)}
        return {**enc, **strip_prefix(local, PERSONAL)}

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
        enc_names = self._block_names(cfg.encoder_block)
        dec_names = self.shared_names()
        w_start = {n: np.array(shared[n], copy=True) for n in dec_names}
        # (w_i, β_i) trained on F_i; γ_i trained on the regularised loss.
        train = {**copy_params({n: local[n] for n in enc_names}), **copy_params(w_start)}
        gamma = copy_params(strip_prefix(local, PERSONAL))
        opt = cfg.make_optimizer(round_)
        opt_gamma = cfg.make_optimizer(round_)
        if cfg.pull == "convex":
            train_loss = self._convex_round(train, gamma, w_start, enc_names, data, opt, opt_gamma, rng)
        else:
            beta_start = {n: np.array(local[n], copy=True) for n in enc_names}
            train_loss = run_local_steps(
                self.model,
                train,
                enc_names + dec_names,
                data,
                self.loss,
                opt,
                cfg.local_steps,
                cfg.batch_size,
                rng,
            )
            self._regularised_gamma(gamma, beta_start, w_start, data, opt_gamma, rng)
        new_local = {**{n: train[n] for n in enc_names}, **with_prefix(gamma, PERSONAL)}
        uploaded = {n: train[n] for n in dec_names}
        return ClientResult(uploaded, len(data), {"train_loss": train_loss}), new_local

    def _convex_round(self, train, gamma, w_start, enc_names, data, opt, opt_gamma, rng) -> float:
        cfg = self.config
        names = enc_names + list(w_start)
        total, done = 0.0, 0
        while done < cfg.local_steps:
            for batch in minibatches(data, cfg.batch_size, rng):
                value, grads = loss_and_grads(self.model, train, batch, self.loss)
                opt.step(train, {n: grads[n] for n in names})
                # γ sees the just-updated encoder, with no gradient flowing into it.
                pers = {**{n: train[n] for n in enc_names}, **gamma}
                _, g_grads = loss_and_grads(self.model, pers, batch, self.loss)
                opt_gamma.step(gamma, {n: g_grads[n] for n in gamma})
                for n in gamma:
                    gamma[n] = cfg.lam * w_start[n] + (1.0 - cfg.lam) * gamma[n]
                total += value
                done += 1
                if done == cfg.local_steps:
                    break
        return total / cfg.local_steps

    def _regularised_gamma(self, gamma, beta_start, w_start, data, opt_gamma, rng) -> None:
        lam = self.config.lam
        frozen = dict(beta_start)

        def penalty(params: Params, grads: Params) -> None:
            for n in grads:
                grads[n] += 2.0 * lam * (params[n] - w_start[n])

        params = {**frozen, **gamma}
        run_local_steps(
            self.model,
            params,
            list(gamma),
            data,
            self.loss,
            opt_gamma,
            self.config.local_steps,
            self.config.batch_size,
            rng,
            grad_hook=penalty,
        )
        gamma.update({n: params[n] for n in gamma})


@dataclass(frozen=True)
class SimpleDAConfig(PFLDAConfig):
    lam: float = 1.0


@register_client
class SimpleDAClient(PFLDAClient):
    """Simple-DA (PFL-DA eq. 1): personal encoder, shared decoder, ``γ = w``."""

    name = "simple_da"
    config_cls = SimpleDAConfig

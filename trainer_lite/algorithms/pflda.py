"""PFL-DA and Simple-DA (Shi & Al Kontar 2023, seed 000, Algorithms 1-3 and eq. 1).

The model is ``g(Φ_β(x))``: a personal encoder ``β`` (block ``encoder``), a shared
decoder ``w`` (block ``decoder``, the only thing uploaded) and, for PFL-DA, a
personal decoder ``γ`` kept near ``w``.  PFL-DA's local state holds ``encoder.*``
(β) and ``personal.decoder.*`` (γ); the device predicts with ``g_γ(Φ_β(x))``.

Two ways to keep γ near w (``pull``):

``"gradient"``
    The paper as written: Algorithm 2 runs E steps on ``(w, β)`` of ``F_i``, then
    Algorithm 3 runs E steps on γ of ``F_i(γ, β^t) + λ1·‖γ − w^t‖²`` with the
    round's starting ``β^t`` and ``w^t``.
``"convex"`` (default; what our reproductions of Table 5 and §4.1 use)
    The authors' public code: after each inner step on ``(w, β)``, one step on γ
    of the plain loss with the just-updated encoder (no gradient into it), then
    ``γ ← λ1·w^t + (1 − λ1)·γ``.  Their printer study pulls after every inner
    step (``pull_at="every"``, λ1 = 0.9); their sine study only after the first
    inner step of each round (``pull_at="first"``).

Both optimizers are created afresh every round (the authors' ``torch.optim.Adam``
per round), so Adam's moments never carry over between rounds.

``feature_center`` adds the authors' NN-only term ``c·mean_k(mean_n Φ(x_n)_k)²``
(their ``0.01·MSELoss(centers.mean(0), ci)`` with zero centres) to the loss of
the ``(w, β)`` steps; it keeps the 128-wide features of ``printer_nn`` centred.

Simple-DA (eq. 1) has no γ: the device predicts with the shared decoder itself,
``g_w(Φ_β(x))``, and only runs Algorithm 2.

Cold start (a device that joins a trained fleet, :meth:`ClientAlgorithm.cold_start`):
the personal encoder β is fitted to the device's first rows through the frozen shared
decoder w of the downlink, and PFL-DA's γ starts at w.  For the one-feature affine
encoder of Table 4 (``φ1·x + φ2``, two numbers) the fit is a grid search over maps of
the rows' range into the decoder's input region, refined by a few optimizer steps
(:func:`trainer_lite.algorithms.cold_start.fit_affine_encoder`); other encoders get
the few steps alone from their seeded start.  Without it a newcomer's random β starts
outside the region w was fitted on, where w is flat, and PFL-DA underfits for dozens
of rounds.  The device's seeded start is kept instead only when it does better on the
device's rows and on its newest rows held out of the fit
(:meth:`_EncoderDecoderClient.fitted_or_start`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import (
    ClientAlgorithm,
    ClientResult,
    LossFn,
    TrainConfig,
    loss_and_grads,
    register_client,
)
from trainer_lite.algorithms.cold_start import affine_block, fit_affine_encoder, fit_personal
from trainer_lite.data import Dataset, minibatches, newest_split
from trainer_lite.layers import Sequential
from trainer_lite.params import Params, copy_params, strip_prefix, with_prefix

PERSONAL = "personal"
_PULLS = ("convex", "gradient")
_PULL_AT = ("every", "first")


def step_batches(
    data: Dataset, batch_size: int | None, steps: int, rng: np.random.Generator
) -> Iterator[tuple[int, Dataset]]:
    """``(step index, batch)`` for ``steps`` steps, cycling through seeded epochs."""
    done = 0
    while done < steps:
        for batch in minibatches(data, batch_size, rng):
            yield done, batch
            done += 1
            if done == steps:
                return


def centered_loss_and_grads(
    model: Sequential, params: Params, data: Dataset, loss: LossFn, weight: float, encoder_block: str
) -> tuple[float, Params]:
    """Loss and gradients plus ``weight · mean_k(mean_n h_nk)²`` on the output ``h`` of ``encoder_block``.

    With ``weight == 0`` this is plain :func:`~trainer_lite.algorithms.base.loss_and_grads`.
    """
    if weight == 0.0:
        return loss_and_grads(model, params, data, loss)
    names = [name for name, _ in model.layers]
    if encoder_block not in names:
        raise ValueError(f"feature_center needs a block {encoder_block!r}; the model has {names}")
    caches, h, feats = [], data.x, None
    for name, layer in model.layers:
        h, cache = layer.forward(strip_prefix(params, name), h)
        caches.append(cache)
        if name == encoder_block:
            feats = h
    value, dy = loss(h, data.y)
    # Over the sample axis (-2), so a stacked (..., n, K) batch gets one term per member.
    mean = feats.mean(axis=-2, keepdims=True)
    value += weight * float(np.sum(np.mean(mean * mean, axis=-1)))
    grads: Params = {}
    for (name, layer), cache in zip(reversed(model.layers), reversed(caches), strict=True):
        if name == encoder_block:
            # d/dh_nk of c·(1/K)·Σ_k m_k² with m_k = (1/n)·Σ_n h_nk is 2c·m_k/(K·n).
            dy = dy + (2.0 * weight / (feats.shape[-1] * feats.shape[-2])) * mean
        g, dy = layer.backward(strip_prefix(params, name), cache, dy)
        grads.update(with_prefix(g, name))
    return value, grads


@dataclass(frozen=True)
class EncoderDecoderConfig(TrainConfig):
    """Local training of a personal-encoder / shared-decoder model.

    Parameters
    ----------
    feature_center
        Weight of the authors' feature-centring term on the ``(w, β)`` steps
        (0.01 for their printer NN, 0 otherwise).
    encoder_block, decoder_block
        Names of the model's encoder and decoder blocks.
    """

    feature_center: float = 0.0
    encoder_block: str = "encoder"
    decoder_block: str = "decoder"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_center < 0:
            raise ValueError(f"feature_center must be >= 0, got {self.feature_center}")


class _EncoderDecoderClient(ClientAlgorithm):
    """Shared machinery: the personal encoder β and Algorithm 2 (local_update)."""

    config_cls = EncoderDecoderConfig

    def encoder_names(self) -> list[str]:
        return sorted(self.model.names(self.config.encoder_block))

    def shared_names(self) -> list[str]:
        return sorted(self.model.names(self.config.decoder_block))

    def fit_encoder(self, shared: Params, local: Params, data: Dataset, rng: np.random.Generator) -> Params:
        """β fitted to ``data`` through the frozen shared decoder of ``shared`` (the cold start)."""
        enc_names = self.encoder_names()
        params = {
            **{n: local[n] for n in enc_names},
            **{n: np.asarray(shared[n]) for n in self.shared_names()},
        }
        if affine_block(self, self.config.encoder_block):
            params = fit_affine_encoder(self, params, self.config.encoder_block, data, rng)
        else:
            params = fit_personal(self, params, enc_names, data, rng)
        return {n: params[n] for n in enc_names}

    def fitted_or_start(
        self, shared: Params, start: Params, data: Dataset, fit: Callable[[Dataset], Params]
    ) -> Params:
        """``fit(data)`` unless the device's seeded start does better both on its newest rows and on all.

        A fleet that joined early may send a decoder no encoder can fit through (after 20 rounds at
        Table 5's rate the printers' w had a negative slope: cold start 32.7 on the newcomer's rows,
        its start 3.4): then the start fits the device's rows better.  But a start that only fits
        the rows it is judged on is no better: a stacked encoder's random start (``printer_nn``) was
        kept when it happened to fit them, and single folds reached 700-1,700.  So the start must
        also beat the fleet's fit on rows neither was fitted to: the newest, held out of a first fit
        on the older ones (for every encoder).  With fewer than two rows nothing can be held out,
        and the fleet's fit is kept.
        """
        older, newest = newest_split(data)
        if not len(newest):
            return fit(data)
        judged = fit(older)
        if self.evaluate(shared, start, newest)["loss"] >= self.evaluate(shared, judged, newest)["loss"]:
            return fit(data)
        fitted = fit(data)
        if self.evaluate(shared, start, data)["loss"] < self.evaluate(shared, fitted, data)["loss"]:
            return start
        return fitted

    def _shared_step(self, train: Params, names: list[str], batch: Dataset, opt) -> float:
        """One step of Algorithm 2 on ``(w_i, β_i)`` (in place); returns the loss before it."""
        cfg = self.config
        value, grads = centered_loss_and_grads(
            self.model, train, batch, self.loss, cfg.feature_center, cfg.encoder_block
        )
        opt.step(train, {n: grads[n] for n in names})
        return value


@dataclass(frozen=True)
class PFLDAConfig(EncoderDecoderConfig):
    """PFL-DA's client settings.

    Parameters
    ----------
    lam
        λ1.  ``pull="convex"``: the weight of ``w`` in ``γ ← λ1·w + (1 − λ1)·γ``
        (in [0, 1]; 0.9 in the authors' code).  ``pull="gradient"``: the ridge
        weight in ``F_i + λ1·‖γ − w‖²`` (>= 0).
    pull
        ``"convex"`` (the authors' code) or ``"gradient"`` (Algorithm 3 as printed).
    pull_at
        Convex pull after ``"every"`` inner step (printer study) or only after the
        ``"first"`` one of each round (the authors' sine study).
    """

    lam: float = 0.9
    pull: str = "convex"
    pull_at: str = "every"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pull not in _PULLS:
            raise ValueError(f"pull must be one of {list(_PULLS)}, got {self.pull!r}")
        if self.pull_at not in _PULL_AT:
            raise ValueError(f"pull_at must be one of {list(_PULL_AT)}, got {self.pull_at!r}")
        if self.lam < 0 or (self.pull == "convex" and self.lam > 1):
            raise ValueError(f"lam must be >= 0 (and <= 1 for the convex pull), got {self.lam}")


@register_client
class PFLDAClient(_EncoderDecoderClient):
    """PFL-DA's client: Algorithm 2 (local_update) and Algorithm 3 (local_update_regularized)."""

    name = "pflda"
    server = "fedavg"
    config_cls = PFLDAConfig

    def init_local(self, rng: np.random.Generator) -> Params:
        full = self.model.init(rng)
        enc = {n: full[n] for n in self.encoder_names()}
        dec = {n: full[n] for n in self.shared_names()}
        return {**enc, **with_prefix(dec, PERSONAL)}

    def cold_start(
        self, shared: Params, local: Params, data: Dataset, *, rng: np.random.Generator, phase: str
    ) -> Params:
        """β fitted through the frozen w (module docstring); γ starts at w."""
        w = copy_params({n: np.asarray(shared[n]) for n in self.shared_names()})
        return self.fitted_or_start(
            shared,
            local,
            data,
            lambda rows: {**self.fit_encoder(shared, local, rows, rng), **with_prefix(w, PERSONAL)},
        )

    def personal_params(self, shared: Params, local: Params) -> Params:
        enc = {n: local[n] for n in self.encoder_names()}
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
        enc_names, dec_names = self.encoder_names(), self.shared_names()
        w_start = {n: np.asarray(shared[n]) for n in dec_names}
        # (w_i, β_i) are trained on F_i; γ_i on the plain or regularised loss.
        train = {**copy_params({n: local[n] for n in enc_names}), **copy_params(w_start)}
        gamma = copy_params(strip_prefix(local, PERSONAL))
        if set(gamma) != set(dec_names):
            raise ValueError(f"local state must hold {PERSONAL}.<decoder names>; got {sorted(local)}")
        opt, opt_gamma = cfg.make_optimizer(round_), cfg.make_optimizer(round_)
        names = enc_names + dec_names
        total = 0.0
        if cfg.pull == "convex":
            for step, batch in step_batches(data, cfg.batch_size, cfg.local_steps, rng):
                total += self._shared_step(train, names, batch, opt)
                # γ sees the just-updated encoder; no gradient flows into it.
                pers = {**{n: train[n] for n in enc_names}, **gamma}
                _, g = loss_and_grads(self.model, pers, batch, self.loss)
                opt_gamma.step(gamma, {n: g[n] for n in dec_names})
                if cfg.pull_at == "every" or step == 0:
                    for n in dec_names:
                        gamma[n] = cfg.lam * w_start[n] + (1.0 - cfg.lam) * gamma[n]
        else:
            # Algorithm 3 uses the round's starting encoder β^t, so keep it.
            beta_start = {n: local[n] for n in enc_names}
            for _, batch in step_batches(data, cfg.batch_size, cfg.local_steps, rng):
                total += self._shared_step(train, names, batch, opt)
            for _, batch in step_batches(data, cfg.batch_size, cfg.local_steps, rng):
                _, g = loss_and_grads(self.model, {**beta_start, **gamma}, batch, self.loss)
                opt_gamma.step(gamma, {n: g[n] + 2.0 * cfg.lam * (gamma[n] - w_start[n]) for n in dec_names})
        new_local = {**{n: train[n] for n in enc_names}, **with_prefix(gamma, PERSONAL)}
        uploaded = {n: train[n] for n in dec_names}
        metrics = {"train_loss": total / cfg.local_steps}
        return ClientResult(uploaded, len(data), metrics), new_local


@register_client
class SimpleDAClient(_EncoderDecoderClient):
    """Simple-DA (PFL-DA eq. 1): personal encoder β, shared decoder w, prediction ``g_w(Φ_β(x))``.

    Only Algorithm 2 runs; the device keeps β and predicts with whatever global
    decoder it was last sent.
    """

    name = "simple_da"
    server = "fedavg"
    config_cls = EncoderDecoderConfig

    def init_local(self, rng: np.random.Generator) -> Params:
        full = self.model.init(rng)
        return {n: full[n] for n in self.encoder_names()}

    def cold_start(
        self, shared: Params, local: Params, data: Dataset, *, rng: np.random.Generator, phase: str
    ) -> Params:
        """β fitted through the frozen shared decoder (module docstring)."""
        return self.fitted_or_start(
            shared, local, data, lambda rows: self.fit_encoder(shared, local, rows, rng)
        )

    def personal_params(self, shared: Params, local: Params) -> Params:
        return {**{n: local[n] for n in self.encoder_names()}, **{n: shared[n] for n in self.shared_names()}}

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
        enc_names, dec_names = self.encoder_names(), self.shared_names()
        train = copy_params({**{n: local[n] for n in enc_names}, **{n: shared[n] for n in dec_names}})
        opt = cfg.make_optimizer(round_)
        total = 0.0
        for _, batch in step_batches(data, cfg.batch_size, cfg.local_steps, rng):
            total += self._shared_step(train, enc_names + dec_names, batch, opt)
        uploaded = {n: train[n] for n in dec_names}
        new_local = {n: train[n] for n in enc_names}
        return ClientResult(uploaded, len(data), {"train_loss": total / cfg.local_steps}), new_local

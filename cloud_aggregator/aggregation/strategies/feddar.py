"""FedDAR's server (Zhong et al. 2023): per-domain head aggregation, then the encoder's weighted mean.

Phases (see :mod:`trainer_lite.algorithms.feddar` for what the devices upload):

``"heads"``
    Each head ``m`` from the uploads of that domain's holders, weights
    ``α_i = L_{i,m}/L_m``: WA, ``w_m = Σ_i α_i w_{i,m}``; or SA (eq. 8),
    ``w_m = (Σ_i α_i H_{i,m})⁻¹ Σ_i α_i H_{i,m} w_{i,m}``, solved on the range of
    the pooled Hessian (previous head elsewhere; ``rcond``).  A domain no
    participant holds keeps its head.  Then ``domain_weight`` becomes
    ``u_m = L/(L_m·M')`` from this round's counts, with ``M'`` the number of
    domains seen (so ``Σ_m u_m L_m = L``).
``"encoder"``
    ``φ = Σ_i (L_i/L) φ_i``.

The encoder mean and WA's head means go through the configured reducer
(``server.reducer``, as FedAvg's): robust rules apply there.  SA's second-order
solve and Algorithm 2 (:class:`FedDARLinear`, sums of statistics and gradients)
are not means of parameters and take only ``"mean"``.

:class:`FedDARLinear` serves Algorithm 2: ``"heads"`` solves
``(Σ_i Bᵀ X_{i,m}ᵀ X_{i,m} B) w_m = Σ_i Bᵀ X_{i,m}ᵀ y_{i,m}`` exactly; ``"encoder"``
steps ``B ← B − η Σ_i g_i / L`` with the devices' summed gradients ``g_i``, then
``B, R = QR(B)`` and ``w_m ← R w_m``, which keeps every prediction ``xᵀ B w_m``
unchanged by the re-orthonormalization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cloud_aggregator.aggregation.reducers import ReducerChoice
from cloud_aggregator.aggregation.second_order import SecondOrderMean, psd_solve
from cloud_aggregator.aggregation.strategies.base import Strategy, TensorSpec, register_strategy
from cloud_aggregator.aggregation.strategies.separate import per_domain_mean, upload_counts
from cloud_aggregator.aggregation.update import Update
from trainer_lite.algorithms.feddar import COUNTS, DOMAIN_WEIGHT, FedDARClient, head_key, hessian_key
from trainer_lite.algorithms.feddar_linear import FedDARLinearClient
from trainer_lite.params import Params


def domain_weights(totals: np.ndarray) -> np.ndarray:
    """``u_m = L/(L_m·M')`` for the ``M'`` domains with ``L_m > 0``; 0 for the others."""
    totals = np.asarray(totals, dtype=np.float64)
    seen = totals > 0
    u = np.zeros_like(totals)
    u[seen] = totals.sum() / (totals[seen] * seen.sum())
    return u


@dataclass(frozen=True)
class FedDARServerConfig(ReducerChoice):
    """``rcond``: relative eigenvalue cutoff of the pooled head Hessian in SA (see ``psd_solve``);
    ``reducer``: the encoder's and WA heads' (see the module docstring)."""

    rcond: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.rcond < 1.0:
            raise ValueError(f"rcond must be in [0, 1), got {self.rcond}")


@register_strategy
class FedDAR(Strategy):
    """Algorithm 1's server; WA or SA as the client's ``aggregation`` hyperparameter says."""

    name = "feddar"
    config_cls = FedDARServerConfig
    #: the encoder and the heads are (weighted, or curvature-weighted) means of decoded uploads;
    #: counts and curvatures travel uncoded beside the codes (``ioft_protocol.compress.encode``)
    compressible = True
    client: FedDARClient

    def _spec(self, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(shape, self.spec.dtype)

    def expected(self, global_params: Params, phase: str) -> dict[str, TensorSpec]:
        """Heads (+ counts, + Hessians for SA) in ``"heads"``; the encoder in ``"encoder"``."""
        c = self.client
        if phase == "heads":
            out = {n: self._spec(tuple(global_params[n].shape)) for n in c.all_head_keys()}
            out[COUNTS] = self._spec((c.n_domains,))
            if c.config.aggregation == "sa":
                p = c.head_param_count()
                out.update({hessian_key(m): self._spec((p, p)) for m in range(c.n_domains)})
            return out
        if phase == "encoder":
            return {n: self._spec(tuple(global_params[n].shape)) for n in c.encoder_names}
        raise ValueError(f"unknown phase {phase!r}; FedDAR's phases are {list(c.phases())}")

    def aggregate(
        self, global_params: Params, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        if phase == "heads":
            return self.aggregate_heads(global_params, updates)
        if phase == "encoder":
            return self.aggregate_encoder(global_params, updates)
        raise ValueError(f"unknown phase {phase!r}; FedDAR's phases are {list(self.client.phases())}")

    def aggregate_heads(self, global_params: Params, updates: Sequence[Update]) -> Params:
        c = self.client
        counts = upload_counts(updates, c.n_domains)
        out: Params = {n: np.array(v, copy=True) for n, v in global_params.items()}
        if c.config.aggregation == "wa":
            reduce = self.config.make_reducer()
            out.update(per_domain_mean(global_params, updates, counts, self._head_keys, reduce))
        else:
            for m in range(c.n_domains):
                out.update(self._second_order(global_params, updates, counts[:, m], m))
        out[DOMAIN_WEIGHT] = domain_weights(counts.sum(axis=0)).astype(global_params[DOMAIN_WEIGHT].dtype)
        return out

    def _head_keys(self, m: int) -> list[str]:
        return [head_key(m, n) for n in self.client.head_names]

    def _second_order(
        self, global_params: Params, updates: Sequence[Update], weights: np.ndarray, m: int
    ) -> Params:
        """Eq. 8 for head ``m``; heads are flattened in the order of the Hessian (weight, then bias)."""
        keys = self._head_keys(m)
        prev = np.concatenate([np.ravel(global_params[k]) for k in keys])
        acc = SecondOrderMean(prev.size)
        for u, w in zip(updates, weights, strict=True):
            if w > 0:
                vec = np.concatenate([np.ravel(u.params[k]) for k in keys])
                acc.add(vec, u.params[hessian_key(m)], float(w))
        new = acc.result(prev, rcond=self.config.rcond)
        out: Params = {}
        start = 0
        for k in keys:
            shape = global_params[k].shape
            size = int(np.prod(shape))
            out[k] = new[start : start + size].reshape(shape).astype(global_params[k].dtype)
            start += size
        return out

    def aggregate_encoder(self, global_params: Params, updates: Sequence[Update]) -> Params:
        names = self.client.encoder_names
        reduce = self.config.make_reducer()
        mean = reduce(global_params, [({n: u.params[n] for n in names}, float(u.n_samples)) for u in updates])
        return {**{n: np.array(v, copy=True) for n, v in global_params.items()}, **mean}


@dataclass(frozen=True)
class FedDARLinearServerConfig(FedDARServerConfig):
    """Algorithm 2's server: ``lr`` (η > 0) is the encoder step size; ``rcond`` as FedDAR's."""

    lr: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reducer != "mean":
            raise ValueError("feddar_linear sums statistics and gradients: only reducer = 'mean' applies")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@register_strategy
class FedDARLinear(FedDAR):
    """Algorithm 2's server: exact head solve, one encoder step, QR."""

    name = "feddar_linear"
    config_cls = FedDARLinearServerConfig
    compressible = False  # it uploads statistics and gradients, not changes of its downlink
    client: FedDARLinearClient

    def expected(self, global_params: Params, phase: str) -> dict[str, TensorSpec]:
        """Per-domain statistics and counts in ``"heads"``; the summed encoder gradient in ``"encoder"``."""
        c = self.client
        w = global_params[c.encoder_weight]
        k, o = global_params[head_key(0, c.head_weight)].shape
        if phase == "heads":
            out = {COUNTS: self._spec((c.n_domains,))}
            for m in range(c.n_domains):
                gram, moment = c.stats_keys(m)
                out[gram] = self._spec((k, k))
                out[moment] = self._spec((k, o))
            return out
        if phase == "encoder":
            return {c.grad_key(): self._spec(tuple(w.shape))}
        raise ValueError(f"unknown phase {phase!r}; Algorithm 2's phases are {list(c.phases())}")

    def aggregate_heads(self, global_params: Params, updates: Sequence[Update]) -> Params:
        c = self.client
        counts = upload_counts(updates, c.n_domains)
        out: Params = {n: np.array(v, copy=True) for n, v in global_params.items()}
        for m in range(c.n_domains):
            gram_key, moment_key = c.stats_keys(m)
            gram = sum(np.asarray(u.params[gram_key], dtype=np.float64) for u in updates)
            moment = sum(np.asarray(u.params[moment_key], dtype=np.float64) for u in updates)
            key = head_key(m, c.head_weight)
            prev = np.asarray(global_params[key], dtype=np.float64)
            # Scale-free cutoff: psd_solve compares eigenvalues to the largest one.
            new = psd_solve(gram, moment, prev, rcond=self.config.rcond)
            out[key] = new.astype(global_params[key].dtype)
        out[DOMAIN_WEIGHT] = domain_weights(counts.sum(axis=0)).astype(global_params[DOMAIN_WEIGHT].dtype)
        return out

    def aggregate_encoder(self, global_params: Params, updates: Sequence[Update]) -> Params:
        c = self.client
        total = sum(u.n_samples for u in updates)
        if total <= 0:
            raise ValueError(
                "Algorithm 2's encoder step needs at least one sample; every upload has n_samples=0"
            )
        grad = sum(np.asarray(u.params[c.grad_key()], dtype=np.float64) for u in updates) / total
        b = np.asarray(global_params[c.encoder_weight], dtype=np.float64) - self.config.lr * grad
        q, r = np.linalg.qr(b)
        out: Params = {n: np.array(v, copy=True) for n, v in global_params.items()}
        dtype = global_params[c.encoder_weight].dtype
        out[c.encoder_weight] = q.astype(dtype)
        for m in range(c.n_domains):
            key = head_key(m, c.head_weight)
            # x·B·w = x·Q·(R·w): absorbing R keeps the model's predictions until the next head solve.
            out[key] = (r @ np.asarray(global_params[key], dtype=np.float64)).astype(global_params[key].dtype)
        return out

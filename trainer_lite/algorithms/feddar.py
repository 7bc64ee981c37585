"""FedDAR (Zhong et al., ICLR 2023, seed 004): a shared encoder φ and one head h_m per domain.

The model is any ``Sequential`` split at ``head_block``: the blocks before it are
the encoder φ (shared by every domain), the blocks from it on are the head,
copied once per domain.  Every sample carries its domain (``Dataset.domain``,
integers in ``[0, n_domains)``) and is predicted by its domain's head.

A round has two phases (Algorithm 1), and all of the model is global:

``"heads"``
    Downlink: encoder ``φ^{t-1}``, heads ``h^{t-1}_m`` (names ``heads.<m>.<head
    param>``) and ``domain_weight``.  The client runs ``head_steps`` (τ_h) steps
    on each of its domains' heads, each on that domain's samples only, with the
    encoder frozen, and uploads every head (an absent domain's head unchanged),
    ``domain_counts`` (its ``L_{i,m}``, shape ``(M,)``) and, for second-order
    aggregation (``aggregation="sa"``), ``hessian.<m>``: the Hessian of its
    domain-``m`` mean loss at the updated head (zeros where it has no samples).
``"encoder"``
    Downlink: encoder ``φ^{t-1}``, the aggregated heads ``h^t_m`` and
    ``domain_weight`` ``u_m = L/(L_m·M)``.  The client runs ``local_steps`` (τ_φ)
    steps on the encoder of ``(1/L_i) Σ_j u_{m_j} ℓ(h_{m_j}(φ(x_j)), y_j)`` and
    uploads the encoder only.

Nothing else leaves the device: the counts are what weighted averaging of the
heads needs anyway, and a head's Hessian is the ``(P, P)`` second moment of the
encoder's features on that domain (for a linear head), never a sample.

Cold start: nothing to do.  A device keeps no state between rounds (the heads are
global), so one that joins a trained fleet predicts with, and trains from, the
global encoder and heads of its first downlink.

Closed-form Hessians of the head: :mod:`trainer_lite.algorithms.head_hessian`.

:mod:`trainer_lite.algorithms.feddar_linear` is Algorithm 2 (the linear case
of the theory) on the same model and phases.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult, TrainConfig, register_client
from trainer_lite.algorithms.domains import COUNTS, domain_ids
from trainer_lite.algorithms.head_hessian import HESSIAN_LOSSES, linear_head_hessian
from trainer_lite.algorithms.training import score
from trainer_lite.data import Dataset, minibatches
from trainer_lite.layers import Linear, Sequential
from trainer_lite.params import Params, copy_params

HEADS = "heads"
DOMAIN_WEIGHT = "domain_weight"
HESSIAN = "hessian"
STATS = "stats"
GRAD = "grad"
PHASES = ("heads", "encoder")
_AGGREGATIONS = ("sa", "wa")


def head_key(m: int, name: str) -> str:
    """Global name of domain ``m``'s copy of head parameter ``name``."""
    return f"{HEADS}.{m}.{name}"


def hessian_key(m: int) -> str:
    return f"{HESSIAN}.{m}"


def split_model(model: Sequential, head_block: str) -> tuple[Sequential, Sequential]:
    """``(encoder, head)``: the blocks before ``head_block`` and the blocks from it on."""
    names = [n for n, _ in model.layers]
    if head_block not in names:
        raise ValueError(f"no head block {head_block!r}; the model's blocks are {names}")
    i = names.index(head_block)
    if i == 0:
        raise ValueError(f"head block {head_block!r} is the first block: FedDAR needs an encoder before it")
    return Sequential(model.layers[:i]), Sequential(model.layers[i:])


def cycle_batches(
    data: Dataset, batch_size: int | None, steps: int, rng: np.random.Generator
) -> Iterator[Dataset]:
    """``steps`` minibatches, cycling through seeded epochs."""
    done = 0
    while done < steps:
        for batch in minibatches(data, batch_size, rng):
            yield batch
            done += 1
            if done == steps:
                return


@dataclass(frozen=True)
class FedDARConfig(TrainConfig):
    """FedDAR's client settings (``TrainConfig``'s ``local_steps`` is τ_φ, the encoder steps).

    Parameters
    ----------
    n_domains
        M, the number of domains (required, >= 1).
    head_block
        The model block where the per-domain head starts.
    head_steps
        τ_h, the head steps per domain in the ``"heads"`` phase.
    head_lr
        Learning rate of the head steps (``None``: ``lr``).
    aggregation
        ``"sa"``: second-order aggregation (eq. 8; uploads Hessians) or ``"wa"``:
        count-weighted average of the heads.  The server reads it from here.
    reweight
        Weight each sample's loss in the encoder steps by ``u_m = L/(L_m·M)``.
    """

    n_domains: int = 0
    head_block: str = "head"
    head_steps: int = 10
    head_lr: float | None = None
    aggregation: str = "sa"
    reweight: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_domains < 1:
            raise ValueError(f"n_domains must be >= 1 (the number of domains M), got {self.n_domains}")
        if self.head_steps < 1:
            raise ValueError(f"head_steps must be >= 1, got {self.head_steps}")
        if self.head_lr is not None and self.head_lr <= 0:
            raise ValueError(f"head_lr must be > 0, got {self.head_lr}")
        if self.aggregation not in _AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {list(_AGGREGATIONS)}, got {self.aggregation!r}")


@register_client
class FedDARClient(ClientAlgorithm):
    """FedDAR's client (Algorithm 1): τ_h head steps per domain, then τ_φ re-weighted encoder steps."""

    name = "feddar"
    server = "feddar"
    config_cls = FedDARConfig
    answers_rows = False  # predict_domains, never predict

    def __init__(self, spec) -> None:
        super().__init__(spec)
        cfg = self.config
        self.encoder, self.head = split_model(self.model, cfg.head_block)
        self.encoder_names = self.encoder.param_names()
        self.head_names = self.head.param_names()
        head = self.head.init(np.random.default_rng(0))
        self._head_size = int(sum(np.asarray(head[n]).size for n in self.head_names))
        self.check_model()

    def check_model(self) -> None:
        """Raise ``ValueError`` when the model and loss do not suit the configured aggregation."""
        if self.config.aggregation == "sa":
            self._linear_head()

    def _linear_head(self) -> Linear:
        """The head's single ``Linear`` layer; raises unless eq. 8 has a closed form here."""
        layers = self.head.layers
        if len(layers) != 1 or not isinstance(layers[0][1], Linear):
            raise ValueError(
                f"second-order aggregation needs the head to be one Linear block, got "
                f"{[n for n, _ in layers]}; use aggregation='wa' for other heads"
            )
        if self.config.loss not in HESSIAN_LOSSES:
            raise ValueError(
                f"second-order aggregation has closed-form Hessians for losses {list(HESSIAN_LOSSES)}, "
                f"got {self.config.loss!r}; use aggregation='wa'"
            )
        return layers[0][1]

    # -- what is shared ---------------------------------------------------
    def phases(self) -> tuple[str, ...]:
        return PHASES

    @property
    def n_domains(self) -> int:
        return self.config.n_domains

    def all_head_keys(self) -> list[str]:
        return [head_key(m, n) for m in range(self.n_domains) for n in self.head_names]

    def shared_names(self) -> list[str]:
        return self.encoder_names + self.all_head_keys()

    def head_param_count(self) -> int:
        """P, the number of scalars in one domain's head (the side of its Hessian)."""
        return self._head_size

    def init_global(self, rng: np.random.Generator) -> Params:
        """Encoder, M independently drawn heads, and ``domain_weight`` (ones until counts arrive)."""
        enc = self.encoder.init(rng)
        out: Params = {n: enc[n] for n in self.encoder_names}
        for m in range(self.n_domains):
            head = self.head.init(rng)
            out.update({head_key(m, n): head[n] for n in self.head_names})
        out[DOMAIN_WEIGHT] = np.ones(self.n_domains)
        return out

    def init_local(self, rng: np.random.Generator) -> Params:
        return {}

    def encoder_params(self, shared: Mapping[str, np.ndarray]) -> Params:
        return {n: shared[n] for n in self.encoder_names}

    def head_params(self, shared: Mapping[str, np.ndarray], m: int) -> Params:
        """Domain ``m``'s head under the head model's own names (``head.weight``...)."""
        return {n: shared[head_key(m, n)] for n in self.head_names}

    def personal_params(self, shared: Params, local: Params) -> Params:
        # Everything is global; personalization is per domain, not per device.
        return dict(shared)

    # -- inference --------------------------------------------------------
    def predict(self, shared: Params, local: Params, x: np.ndarray) -> np.ndarray:
        raise ValueError(
            f"{self.name} predicts with each sample's domain head: call "
            "predict_domains(shared, local, x, domain)"
        )

    def predict_domains(self, shared: Params, local: Params, x: np.ndarray, domain: np.ndarray) -> np.ndarray:
        """Predictions of ``h_{domain_j}(φ(x_j))`` for every row."""
        dom = domain_ids(Dataset(x, np.zeros(len(x)), domain), self.n_domains)
        z = self.encoder(self.encoder_params(shared), x)
        out: np.ndarray | None = None
        for m in np.unique(dom):
            idx = np.flatnonzero(dom == m)
            pm = self.head(self.head_params(shared, int(m)), z[idx])
            if out is None:
                out = np.empty((len(x), *pm.shape[1:]), dtype=pm.dtype)
            out[idx] = pm
        if out is None:  # no rows: run a head on nothing for the output width
            out = self.head(self.head_params(shared, 0), z)
        return out

    def evaluate(self, shared: Params, local: Params, data: Dataset) -> dict[str, float]:
        """Loss of each sample under its domain's head (and accuracy for class targets)."""
        return score(self.loss, self.predict_domains(shared, local, data.x, data.domain), data.y)

    # -- the round --------------------------------------------------------
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
        if phase == "heads":
            return self.heads_phase(shared, data, rng=rng, round_=round_), {}
        if phase == "encoder":
            return self.encoder_phase(shared, data, rng=rng, round_=round_), {}
        raise ValueError(f"unknown phase {phase!r} for {self.name}; phases are {list(PHASES)}")

    def heads_phase(
        self, shared: Params, data: Dataset, *, rng: np.random.Generator, round_: int
    ) -> ClientResult:
        """τ_h steps on each present domain's head with the encoder frozen; upload heads, counts (Hessians)."""
        cfg = self.config
        groups = dict(self.domain_groups(data))
        z = self.encoder(self.encoder_params(shared), data.x)
        upload: Params = {}
        counts = np.zeros(self.n_domains)
        total = 0.0
        for m in range(self.n_domains):
            head = copy_params(self.head_params(shared, m))
            idx = groups.get(m, np.zeros(0, dtype=np.intp))
            counts[m] = len(idx)
            if len(idx):
                sub = Dataset(z[idx], data.y[idx])
                # A fresh optimizer per domain: every head shares the head model's names.
                total += len(idx) * self.local_steps(
                    head,
                    sub,
                    rng,
                    round_=round_,
                    trainable=self.head_names,
                    steps=cfg.head_steps,
                    lr=cfg.head_lr,
                    model=self.head,
                )
            upload.update({head_key(m, n): head[n] for n in self.head_names})
            if cfg.aggregation == "sa":
                upload[hessian_key(m)] = self._hessian(head, z[idx])
        upload[COUNTS] = counts
        return ClientResult(upload, len(data), {"train_loss": total / max(len(data), 1)})

    def _hessian(self, head: Params, z: np.ndarray) -> np.ndarray:
        """Hessian of the domain's mean loss at ``head``; zeros when the client has no such samples."""
        p = self.head_param_count()
        if len(z) == 0:
            return np.zeros((p, p))
        pred = self.head(head, z)
        return linear_head_hessian(z, pred, self.config.loss, bias=self._linear_head().bias)

    def domain_groups(self, batch: Dataset) -> list[tuple[int, np.ndarray]]:
        """``[(m, row indices of domain m), ...]`` for the domains present in ``batch``."""
        dom = domain_ids(batch, self.n_domains)
        order = np.argsort(dom, kind="stable")
        present, starts = np.unique(dom[order], return_index=True)
        bounds = [*starts[1:], len(dom)]
        return [(int(m), order[a:b]) for m, a, b in zip(present, starts, bounds, strict=True)]

    def encoder_loss_and_grads(
        self,
        enc: Params,
        heads: list[Params],
        batch: Dataset,
        weights: np.ndarray | None,
        groups: list[tuple[int, np.ndarray]] | None = None,
    ) -> tuple[float, Params]:
        """Re-weighted loss ``(1/n) Σ_j u_{m_j} ℓ_j`` of a batch and its gradient in the encoder.

        ``groups`` (from :meth:`domain_groups`) saves regrouping when the batch repeats.
        """
        if groups is None:
            groups = self.domain_groups(batch)
        if not groups:
            raise ValueError("cannot take an encoder step on an empty batch")
        z, enc_cache = self.encoder.forward(enc, batch.x)
        pred: np.ndarray | None = None
        caches = []
        for m, idx in groups:
            pm, cache = self.head.forward(heads[m], z[idx])
            if pred is None:
                pred = np.empty((len(z), *pm.shape[1:]), dtype=pm.dtype)
            pred[idx] = pm
            caches.append(cache)
        if weights is None:
            value, dpred = self.loss(pred, batch.y)
        else:
            w = np.empty(len(z))
            for m, idx in groups:
                w[idx] = weights[m]
            value, dpred = self.loss(pred, batch.y, sample_weights=w)
        dz = np.empty_like(z)
        for (m, idx), cache in zip(groups, caches, strict=True):
            _, dz[idx] = self.head.backward(heads[m], cache, dpred[idx])
        return value, self.encoder.param_grads(enc, enc_cache, dz)

    def _weights(self, shared: Params) -> np.ndarray | None:
        if not self.config.reweight:
            return None
        return np.asarray(shared[DOMAIN_WEIGHT], dtype=np.float64)

    def encoder_phase(
        self, shared: Params, data: Dataset, *, rng: np.random.Generator, round_: int
    ) -> ClientResult:
        """τ_φ steps on the encoder with the round's aggregated heads fixed; upload the encoder."""
        cfg = self.config
        enc = copy_params(self.encoder_params(shared))
        heads = [self.head_params(shared, m) for m in range(self.n_domains)]
        weights = self._weights(shared)
        opt = cfg.make_optimizer(round_)
        # Full batches repeat: group the rows by domain once.
        full = self.domain_groups(data) if cfg.batch_size is None or cfg.batch_size >= len(data) else None
        total = 0.0
        for batch in cycle_batches(data, cfg.batch_size, cfg.local_steps, rng):
            value, grads = self.encoder_loss_and_grads(enc, heads, batch, weights, full)
            opt.step(enc, grads)
            total += value
        return ClientResult(enc, len(data), {"train_loss": total / cfg.local_steps})

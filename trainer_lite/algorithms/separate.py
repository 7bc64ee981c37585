"""Separate FedAvg per domain (FedDAR's baseline): one FedAvg model per domain.

The global state holds M copies of the model, ``domains.<m>.<param>``.  Each round
a device trains domain ``m``'s copy for ``local_steps`` steps on its own
domain-``m`` samples only (a fresh optimizer per domain), and uploads every copy
(an absent domain's unchanged) plus ``domain_counts`` (``L_{i,m}``, shape
``(M,)``); the server averages each copy over the devices weighted by their
counts (:mod:`cloud_aggregator.aggregation.strategies.separate`).  The device predicts each
sample with its domain's model; it keeps nothing between rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult, TrainConfig, register_client
from trainer_lite.algorithms.domains import COUNTS, domain_counts, domain_ids
from trainer_lite.algorithms.training import score
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params

DOMAINS = "domains"


def domain_key(m: int, name: str) -> str:
    """Global name of domain ``m``'s copy of model parameter ``name``."""
    return f"{DOMAINS}.{m}.{name}"


@dataclass(frozen=True)
class SeparateConfig(TrainConfig):
    """FedAvg's local settings plus ``n_domains`` (M, required)."""

    n_domains: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_domains < 1:
            raise ValueError(f"n_domains must be >= 1 (the number of domains M), got {self.n_domains}")


@register_client
class SeparateFedAvgClient(ClientAlgorithm):
    """M independent FedAvg models, domain ``m``'s trained on domain-``m`` samples only."""

    name = "separate_fedavg"
    server = "separate_fedavg"
    config_cls = SeparateConfig

    @property
    def n_domains(self) -> int:
        return self.config.n_domains

    def model_names(self) -> list[str]:
        return self.model.param_names()

    def shared_names(self) -> list[str]:
        return [domain_key(m, n) for m in range(self.n_domains) for n in self.model_names()]

    def init_global(self, rng: np.random.Generator) -> Params:
        out: Params = {}
        for m in range(self.n_domains):
            full = self.model.init(rng)
            out.update({domain_key(m, n): v for n, v in full.items()})
        return out

    def init_local(self, rng: np.random.Generator) -> Params:
        return {}

    def domain_params(self, shared: Mapping[str, np.ndarray], m: int) -> Params:
        """Domain ``m``'s model under the model's own names."""
        return {n: shared[domain_key(m, n)] for n in self.model_names()}

    def personal_params(self, shared: Params, local: Params) -> Params:
        return dict(shared)

    def predict(self, shared: Params, local: Params, x: np.ndarray) -> np.ndarray:
        raise ValueError(
            f"{self.name} predicts with each sample's domain model: call predict_domains(shared, local, x, domain)"
        )

    def predict_domains(self, shared: Params, local: Params, x: np.ndarray, domain: np.ndarray) -> np.ndarray:
        dom = domain_ids(Dataset(x, np.zeros(len(x)), domain), self.n_domains)
        out: np.ndarray | None = None
        for m in np.unique(dom):
            idx = np.flatnonzero(dom == m)
            pm = self.model(self.domain_params(shared, int(m)), x[idx])
            if out is None:
                out = np.empty((len(x), *pm.shape[1:]), dtype=pm.dtype)
            out[idx] = pm
        if out is None:
            out = self.model(self.domain_params(shared, 0), x)
        return out

    def evaluate(self, shared: Params, local: Params, data: Dataset) -> dict[str, float]:
        """Loss of each sample under its domain's model (and accuracy for class targets)."""
        return score(self.loss, self.predict_domains(shared, local, data.x, data.domain), data.y)

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
        dom = domain_ids(data, self.n_domains)
        counts = domain_counts(dom, self.n_domains)
        upload: Params = {}
        total = 0.0
        for m in range(self.n_domains):
            params = copy_params(self.domain_params(shared, m))
            idx = np.flatnonzero(dom == m)
            if len(idx):
                total += len(idx) * self.local_steps(params, data.take(idx), rng, round_=round_)
            upload.update({domain_key(m, n): v for n, v in params.items()})
        upload[COUNTS] = counts.astype(np.float64)
        return ClientResult(upload, len(data), {"train_loss": total / max(len(data), 1)}), {}

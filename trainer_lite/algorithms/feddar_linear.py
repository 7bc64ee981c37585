"""FedDAR's Algorithm 2 (Zhong et al. 2023, App. A.2): linear regression with an exact head solve.

The model is ``xᵀ B w_m`` (``linear_rep``: a bias-free ``Linear`` encoder ``B`` and
bias-free ``Linear`` heads ``w_m``), the phases are FedDAR's, and the encoder
step and the head solve happen at the server
(:class:`cloud_aggregator.aggregation.strategies.feddar.FedDARLinear`):

``"heads"``
    Upload, for every domain, ``stats.<m>.gram = Bᵀ X_mᵀ X_m B`` ``(k, k)`` and
    ``stats.<m>.moment = Bᵀ X_mᵀ Y_m`` ``(k, o)`` (sums over the client's
    domain-``m`` samples, zeros where it has none) and ``domain_counts``.
``"encoder"``
    Upload ``grad.<encoder weight> = Σ_j u_{m_j} ∇_B (w_{m_j}ᵀ Bᵀ x_j − y_j)²``, the
    gradient of the re-weighted loss summed (not averaged) over the client's samples.

As in App. B.3.1 the same samples serve every round (the theory draws fresh ones)
and ``B`` starts at random rather than from the spectral initialization of
Theorem A.13.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientResult, TrainConfig, register_client
from trainer_lite.algorithms.domains import COUNTS, domain_counts, domain_ids
from trainer_lite.algorithms.feddar import GRAD, STATS, FedDARClient
from trainer_lite.data import Dataset
from trainer_lite.layers import Linear
from trainer_lite.params import Params


@dataclass(frozen=True)
class FedDARLinearConfig(TrainConfig):
    """Algorithm 2's client settings: ``n_domains``, ``head_block`` and ``reweight`` as FedDAR's.

    The encoder step size is the server's (``TaskSpec.server["lr"]``); ``lr``,
    ``optimizer`` and ``local_steps`` are unused.
    """

    n_domains: int = 0
    head_block: str = "head"
    reweight: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_domains < 1:
            raise ValueError(f"n_domains must be >= 1 (the number of domains M), got {self.n_domains}")
        if self.loss != "mse":
            raise ValueError(
                f"Algorithm 2 is FedDAR for linear regression: loss must be 'mse', got {self.loss!r}"
            )


@register_client
class FedDARLinearClient(FedDARClient):
    """Algorithm 2's client: sufficient statistics for the heads, the summed gradient for the encoder.

    The server solves ``(Σ_i gram) w_m = Σ_i moment`` for each head, steps
    ``B ← B − η Σ_i grad_i / L`` and orthonormalizes ``B`` by QR.
    """

    name = "feddar_linear"
    server = "feddar_linear"
    config_cls = FedDARLinearConfig

    def check_model(self) -> None:
        """Raise ``ValueError`` unless the model is a bias-free linear encoder and head."""
        blocks = [*self.encoder.layers, *self.head.layers]
        if len(blocks) != 2 or not all(isinstance(layer, Linear) and not layer.bias for _, layer in blocks):
            raise ValueError(
                "Algorithm 2 needs the model to be a bias-free Linear encoder and a bias-free Linear head "
                f"(model 'linear_rep'), got blocks {[n for n, _ in blocks]}"
            )

    @property
    def encoder_weight(self) -> str:
        """The name of ``B``."""
        return self.encoder_names[0]

    @property
    def head_weight(self) -> str:
        """The name of a head's ``w`` (under the head model's names)."""
        return self.head_names[0]

    def grad_key(self) -> str:
        return f"{GRAD}.{self.encoder_weight}"

    @staticmethod
    def stats_keys(m: int) -> tuple[str, str]:
        return f"{STATS}.{m}.gram", f"{STATS}.{m}.moment"

    def heads_phase(
        self, shared: Params, data: Dataset, *, rng: np.random.Generator, round_: int
    ) -> ClientResult:
        dom = domain_ids(data, self.n_domains)
        counts = domain_counts(dom, self.n_domains)
        z = self.encoder(self.encoder_params(shared), data.x).astype(np.float64)
        y = np.asarray(data.y, dtype=np.float64).reshape(len(z), -1)
        upload: Params = {}
        for m in range(self.n_domains):
            idx = np.flatnonzero(dom == m)
            gram, moment = self.stats_keys(m)
            upload[gram] = z[idx].T @ z[idx]
            upload[moment] = z[idx].T @ y[idx]
        upload[COUNTS] = counts.astype(np.float64)
        return ClientResult(upload, len(data), {})

    def encoder_phase(
        self, shared: Params, data: Dataset, *, rng: np.random.Generator, round_: int
    ) -> ClientResult:
        enc = self.encoder_params(shared)
        heads = [self.head_params(shared, m) for m in range(self.n_domains)]
        value, grads = self.encoder_loss_and_grads(enc, heads, data, self._weights(shared))
        # The loss is a mean over the client's samples; the server wants the sum.
        upload = {self.grad_key(): grads[self.encoder_weight] * len(data)}
        return ClientResult(upload, len(data), {"train_loss": value})

"""FedPP / FEDORA's client (Wu, Bao, Ainsworth & He, KDD 2023, seed 002): selective regularization.

The device keeps a personal model θ_k (local state ``personal.*``) and receives from
the server its own *auxiliary* model θ̂_k, the propagated mix of similar devices'
models (a per-device downlink; :mod:`cloud_aggregator.aggregation.strategies.fedpp`).  Each
round it solves the client step of the FEDORA objective (the slides' "Step 1"):

    min_θk  (1/n_k) Σ_i ℓ(x_i, y_i; θ_k) + λ_k ‖θ_k − θ̂_k‖²

whose gradient adds ``2λ_k(θ_k − θ̂_k)`` to the loss gradient at every local step.
λ_k is *selective*: it is read from the validation losses of the current θ_k and
of θ̂_k before the round's training (``lam_rule``):

``"max"`` (default)
    The slides' formula: ``Δ = ℓ(θ_k) − ℓ(θ̂_k)``, λ = max(ε, Δ), ε = 1e-8.
``"exp"``
    The authors' public code (``main_fedora.py``): λ = 0 when Δ < 0, else exp(Δ/2).

Both switch the pull off when θ̂_k is worse on held-out data than what the
device has alone (that is what keeps a device from negative transfer, the
paper's PTR).  They differ when θ̂_k is better: the slides' λ is the loss gap
itself (about 0.1 on the digits study), the code's jumps from 0 to at least 1
as Δ crosses 0.  The slides' rule is the default: it is the method as the
paper states it, and it is graded, so validation noise around Δ = 0 (a few
held-out samples per device) gives a weak pull, not a switch between none and
a strong one.  On the rotated-digits study (``benchmarks/fedpp_digits.py``,
``benchmarks/results/fedpp_digits.md``) both rules reach the same mean
accuracy and PTR (within a seed's spread); the slides' rule keeps the one
large client of the imbalanced setting at its LOCAL accuracy (+0.004, the
code's −0.015).  Neither reaches the slides' PTR = 1.0 (0.97 balanced, 0.92
imbalanced with the default rule): λ reads validation *loss*, and a less
confident θ̂_k can have the lower loss and the lower accuracy, so the pull stays
on toward a worse classifier (the results file lists the losing clients).

Validation data: a fixed ``val_fraction`` of the device's training set (drawn
once from the task seed and the dataset size, the same every round) is held
out of training and used only for λ_k; the paper gives each client a separate
validation split.  ``val_fraction = 0`` measures both losses on the training
data (biased toward θ_k).

What leaves the device (the slides' "Step 2"): θ_k itself, under the model's own
parameter names, which the server propagates (Step 3); and, while the downlink's
``fedpp.send_basis`` flag is set, ``fedpp.basis``: the ``subspace_dim`` (p)
leading right singular vectors of the device's data matrix (truncated SVD, the
slides' "Step 0"): X_k with the one-hot labels appended, as the authors' code
(``subspace_labels``), shape ``(d_in + classes, p)``.  The server clears the flag once it
holds the basis, so the basis leaves once (again only if that upload was lost).
Nothing else does: not the data, not the validation losses beyond the scalar
metrics ``lam`` and ``val_gap``.

The first downlink (the broadcast θ⁰, the same for every device) also
initialises θ_k: averaging MLPs only makes sense from a common initialisation,
as the authors' code does (every client starts from ``net_glob``).

Cold start (a device that joins a trained fleet): the server has no basis for it,
so its first downlink is the broadcast θ⁰ and its first round trains from there as
at round 1.  Its local state carries ``fedpp.joined`` until the first downlink of its
own arrives (the θ̂_k the server propagated from its nearest neighbours once its
first upload and basis arrived); θ_k then restarts from that θ̂_k instead of going
on from the few steps it took from θ⁰.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult, TrainConfig, register_client
from trainer_lite.algorithms.pflda import PERSONAL
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params, strip_prefix, with_prefix

BASIS = "fedpp.basis"
SEND_BASIS = "fedpp.send_basis"
#: Local-state flag of a device that joined a trained fleet and has not yet had its own θ̂_k.
JOINED = "fedpp.joined"
LAM_RULES = ("exp", "max")


def selective_lambda(loss_personal: float, loss_aux: float, rule: str = "max", eps: float = 1e-8) -> float:
    """λ_k from ``Δ = ℓ(θ_k; D_val) − ℓ(θ̂_k; D_val)`` (module docstring).

    ``"max"``: ``max(ε, Δ)`` (slides); ``"exp"``: 0 if Δ < 0 else exp(Δ/2) (authors' code).
    """
    diff = float(loss_personal) - float(loss_aux)
    if not math.isfinite(diff):
        raise ValueError(f"validation losses must be finite, got {loss_personal} and {loss_aux}")
    if rule == "max":
        return max(eps, diff)
    if rule == "exp":
        return 0.0 if diff < 0 else math.exp(diff / 2.0)
    raise ValueError(f"unknown lam_rule {rule!r}; choose one of {list(LAM_RULES)}")


def subspace_basis(x: np.ndarray, p: int, y: np.ndarray | None = None, n_outputs: int = 0) -> np.ndarray:
    """The ``p`` leading right singular vectors of the device's data matrix, as a ``(width, p)`` basis.

    The matrix is ``x`` (n × d_in) or, with ``y``, ``[x, onehot(y)]`` for class ids
    (``n_outputs`` classes) and ``[x, y]`` otherwise, as the authors' code does
    (``torch.cat([x, y_vector[y]])`` before ``svd_lowrank``).  Uncentred, as the slides
    (``X_k = U_k Σ_k V_kᵀ``): the mean direction is part of what tells devices apart.
    """
    x = np.asarray(x, dtype=np.float64)
    if y is not None:
        y = np.asarray(y)
        if y.ndim == 1 and y.dtype.kind in "iu":
            if y.size and (y.min() < 0 or y.max() >= n_outputs):
                raise ValueError(f"class ids must lie in [0, {n_outputs}), got {y.min()}..{y.max()}")
            cols = np.eye(n_outputs)[y]
        else:
            cols = y.reshape(len(y), -1).astype(np.float64)
        x = np.concatenate([x, cols], axis=1)
    n, d = x.shape
    if not 1 <= p <= min(n, d):
        raise ValueError(
            f"subspace_dim p={p} needs 1 <= p <= min(samples, width) = min({n}, {d}); "
            "lower hparams['subspace_dim'] or give the device more data"
        )
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    return vt[:p].T


def validation_split(data: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """``(train, val)``: a fixed ``fraction`` held out, the same rows every round for the same data."""
    n = len(data)
    n_val = round(fraction * n)
    if fraction <= 0 or n < 2:
        return data, data
    n_val = min(max(1, n_val), n - 1)
    perm = np.random.default_rng([seed, n]).permutation(n)
    return data.take(np.sort(perm[n_val:])), data.take(np.sort(perm[:n_val]))


@dataclass(frozen=True)
class FedPPConfig(TrainConfig):
    """FEDORA's client settings.

    Attributes
    ----------
    lam_rule
        ``"max"`` (the slides, default) or ``"exp"`` (the authors' code), see the module docstring.
    eps
        ε of the ``"max"`` rule.
    val_fraction
        Share of the device's data held out for the validation losses, in [0, 1).
    subspace_dim
        p, the number of basis vectors of the data subspace uploaded once.
    subspace_labels
        Append the targets (one-hot class ids) to the inputs before the SVD, as the
        authors' code does; then the subspace reflects p(x, y), not only p(x).
    epochs
        Local epochs (``epochs·⌈n/B⌉`` steps, the authors' ``inner_steps``); ``None`` uses ``local_steps``.
    """

    lam_rule: str = "max"
    eps: float = 1e-8
    val_fraction: float = 0.2
    subspace_dim: int = 10
    subspace_labels: bool = True
    epochs: int | None = None
    loss: str = "cross_entropy"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lam_rule not in LAM_RULES:
            raise ValueError(f"lam_rule must be one of {list(LAM_RULES)}, got {self.lam_rule!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.subspace_dim < 1:
            raise ValueError(f"subspace_dim must be >= 1, got {self.subspace_dim}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {self.epochs}")


@register_client
class FedPPClient(ClientAlgorithm):
    """A FEDORA device: personal θ_k pulled selectively toward its propagated θ̂_k."""

    name = "fedpp"
    server = "fedpp"
    config_cls = FedPPConfig

    def model_names(self) -> list[str]:
        return sorted(self.model.param_names())

    def shared_names(self) -> list[str]:
        """The downlink: θ̂_k under the model's names, and the send-basis flag."""
        return [*self.model_names(), SEND_BASIS]

    def _widths(self) -> tuple[int, int]:
        """``(d_in, d_out)``: input width of the first layer with parameters, output width of the last."""
        layers = [layer for _, layer in self.model.layers if layer.param_names()]
        d_in = getattr(layers[0], "d_in", None) if layers else None
        d_out = getattr(layers[-1], "d_out", None) if layers else None
        if d_in is None or d_out is None:
            raise ValueError("FedPP needs a model whose first and last layers with parameters are Linear")
        return int(d_in), int(d_out)

    def basis_width(self) -> int:
        """Rows of the uploaded basis: d_in, plus the output width with ``subspace_labels``."""
        d_in, d_out = self._widths()
        return d_in + d_out if self.config.subspace_labels else d_in

    def init_global(self, rng: np.random.Generator) -> Params:
        """θ⁰ for every device (the common start), with the flag asking for the basis."""
        return {**self.model.init(rng), SEND_BASIS: np.ones(1)}

    def init_local(self, rng: np.random.Generator) -> Params:
        return {}  # θ_k starts from the first downlink (module docstring)

    def cold_start(
        self, shared: Params, local: Params, data: Dataset, *, rng: np.random.Generator, phase: str
    ) -> Params:
        """Mark the device as joined: θ_k restarts from its first own θ̂_k (module docstring)."""
        return {**local, JOINED: np.ones(1)}

    def personal_params(self, shared: Params, local: Params) -> Params:
        personal = strip_prefix(local, PERSONAL)
        if personal:
            return personal
        return {n: shared[n] for n in self.model_names()}

    def val_loss(self, params: Params, data: Dataset) -> float:
        value, _ = self.loss(self.model(params, data.x), data.y)
        return float(value)

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
        cfg: FedPPConfig = self.config
        names = self.model_names()
        aux = {n: np.asarray(shared[n]) for n in names}  # θ̂_k, fixed during the round
        broadcast = float(np.asarray(shared[SEND_BASIS]).reshape(-1)[0]) > 0.5
        joined = JOINED in local
        if joined and not broadcast:  # a newcomer's first own θ̂_k: start from its neighbours
            local, joined = {}, False
        theta = copy_params(self.personal_params(shared, local))
        train, val = validation_split(data, cfg.val_fraction, self.spec.seed)
        loss_theta, loss_aux = self.val_loss(theta, val), self.val_loss(aux, val)
        lam = selective_lambda(loss_theta, loss_aux, cfg.lam_rule, cfg.eps)

        def pull(p: Params, grads: Params) -> None:
            # ∇ λ‖θ − θ̂‖² = 2λ(θ − θ̂) (the client objective; the authors' code steps with λ(θ − θ̂)).
            for n in grads:
                grads[n] = grads[n] + 2.0 * lam * (p[n] - aux[n])

        steps = cfg.local_steps
        if cfg.epochs is not None:
            per_epoch = 1 if cfg.batch_size is None else math.ceil(len(train) / cfg.batch_size)
            steps = cfg.epochs * per_epoch
        train_loss = self.local_steps(
            theta,
            train,
            rng,
            round_=round_,
            trainable=names,
            steps=steps,
            grad_hook=pull if lam > 0 else None,
        )
        upload: Params = {n: theta[n] for n in names}
        if broadcast:
            y = data.y if cfg.subspace_labels else None
            upload[BASIS] = subspace_basis(data.x, cfg.subspace_dim, y, self._widths()[1])
        metrics = {"train_loss": train_loss, "lam": lam, "val_gap": loss_theta - loss_aux}
        kept = with_prefix(theta, PERSONAL) | ({JOINED: np.ones(1)} if joined else {})
        return ClientResult(upload, len(data), metrics), kept

"""Personalized PCA, client side (Shi & Kontar, "Personalized PCA: decoupling shared and unique features", JMLR 25, 2024).

Each device models its (centred) data as global components ``U`` (``d × r1``,
shared, uploaded) plus local components ``V_i`` (``d × r2``, never uploaded),
with ``[U, V_i]`` orthonormal, and maximises its term of the paper's eq. (4)::

    f_i(U, V_i) = ½ Tr(Uᵀ S_i U) + ½ Tr(V_iᵀ S_i V_i),   S_i = X_iᵀ X_i / n_i,

which, for orthonormal ``W = [U, V_i]``, is ``½ (Tr S_i − residual)``: the same as
minimising the mean squared reconstruction residual ``‖x − W Wᵀ x‖²``.

One round on a device (the talk's "Personalized PCA: Algorithm"):

1. correction -- the averaged ``U`` from the server is no longer orthogonal to the
   device's ``V_i``; deflate and retract, ``V_i ← GR(V_i − U Uᵀ V_i)``.  The polar
   retraction keeps the column space, so the result stays orthogonal to ``U``;
2. ``local_steps`` Stiefel gradient-ascent steps on ``W = [U, V_i]``: the Euclidean
   gradient ``S_i W`` projected on the tangent space of St(d, r1+r2) (eq. 6,
   ``P_T(G) = G − W sym(Wᵀ G)``), a step of ``lr``, then the polar retraction;
3. upload the ``U`` block; keep the ``V`` block.

The server averages the uploaded ``U_i`` and retracts (``U ← polar(mean U_i)``,
:mod:`cloud_aggregator.aggregation.strategies.perpca`).  The authors' code
(github.com/soundsinteresting/perpca, ``algs.py``) takes one step per round with
the unprojected gradient; the default here (``local_steps=1``) matches the count,
and the projection follows the talk's eq. (6).

No model from :mod:`trainer_lite.models` is involved: the parameters are the
two orthonormal blocks, named ``"U"`` (shared) and ``"V"`` (local).  Data are
:class:`~trainer_lite.data.Dataset` rows ``x``; ``y`` is ignored.

Cold start (a device that joins a trained fleet): ``V_i`` starts as the ``r2`` leading
eigenvectors of the device's first rows' covariance deflated by the downlinked ``U``,
``(I − UUᵀ) S_i (I − UUᵀ)``: the maximiser of ``f_i`` for that ``U``, in closed form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import (
    ClientAlgorithm,
    ClientResult,
    algorithm_hparams,
    build_config,
    register_client,
)
from trainer_lite.data import Dataset
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec


@dataclass(frozen=True)
class PerPCAConfig:
    """Hyperparameters of a personalized-PCA task.

    Parameters
    ----------
    dim
        Data dimension d.
    r_global, r_local
        Numbers of global (r1) and local (r2) components; ``r1 + r2 <= d``.
    lr
        Stiefel gradient step η.  The step is taken on ``S_i = XᵀX/n``: scale η to
        ``1 / λ_max(S_i)`` or so.
    local_steps
        Stiefel steps per round (1 in the authors' code).
    center
        Subtract the local mean before forming ``S_i`` (each device centres its own
        data; the mean is not uploaded).
    """

    dim: int
    r_global: int
    r_local: int
    lr: float = 0.1
    local_steps: int = 1
    center: bool = True

    def __post_init__(self) -> None:
        if self.dim < 1 or self.r_global < 1 or self.r_local < 0:
            raise ValueError(
                f"need dim >= 1, r_global >= 1, r_local >= 0; got {self.dim}, {self.r_global}, {self.r_local}"
            )
        if self.r_global + self.r_local > self.dim:
            raise ValueError(f"r_global + r_local = {self.r_global + self.r_local} exceeds dim = {self.dim}")
        if not self.lr > 0 or self.local_steps < 1:
            raise ValueError(f"need lr > 0 and local_steps >= 1, got {self.lr}, {self.local_steps}")


# -- Stiefel-manifold tools (pure NumPy, reused by the server and the studies) --------


def polar(a: np.ndarray) -> np.ndarray:
    """The polar factor ``A (AᵀA)^{-1/2}`` of a full-column-rank ``A``: the nearest orthonormal matrix.

    This is the talk's polar generalized retraction ``GR_polar,U(ξ) = (U + ξ)(I + ξᵀU
    + Uᵀξ + ξᵀξ)^{-1/2}`` evaluated at ``A = U + ξ``; it preserves the column space.
    Computed from the thin SVD ``A = P Σ Qᵀ`` as ``P Qᵀ``.
    """
    p, s, qt = np.linalg.svd(a, full_matrices=False)
    if s.size and s[-1] <= s[0] * np.finfo(a.dtype).eps * max(a.shape):
        raise ValueError("polar retraction of a rank-deficient matrix: its column space has collapsed")
    return p @ qt


def tangent_project(w: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Projection of ``g`` on the tangent space of the Stiefel manifold at ``w`` (eq. 6)."""
    wg = w.T @ g
    return g - w @ (wg + wg.T) / 2


def correct_local(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``V ← GR(V − U Uᵀ V)``: deflate ``V`` off the new global ``U`` and retract (polar)."""
    if v.shape[1] == 0:
        return v.copy()
    return polar(v - u @ (u.T @ v))


def covariance(x: np.ndarray, center: bool) -> np.ndarray:
    """``S = XᵀX / n`` of the (optionally centred) rows ``x``."""
    xc = x - x.mean(axis=0) if center else x
    return xc.T @ xc / max(len(xc), 1)


def objective(s: np.ndarray, u: np.ndarray, v: np.ndarray) -> float:
    """One device's term of eq. (4): ``½ Tr(UᵀSU) + ½ Tr(VᵀSV)``."""
    return 0.5 * float(np.trace(u.T @ s @ u) + np.trace(v.T @ s @ v))


def objective_grad(s: np.ndarray, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Euclidean gradient of :func:`objective` (``S`` symmetric): ``(S U, S V)``."""
    return s @ u, s @ v


def stiefel_step(s: np.ndarray, u: np.ndarray, v: np.ndarray, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """One Riemannian gradient-ascent step on ``W = [U, V]``: ``W ← polar(W + η P_T(S W))``."""
    w = np.concatenate([u, v], axis=1)
    w = polar(w + lr * tangent_project(w, s @ w))
    r1 = u.shape[1]
    return w[:, :r1], w[:, r1:]


def residual(x: np.ndarray, u: np.ndarray, v: np.ndarray, mean: np.ndarray | None = None) -> np.ndarray:
    """Per-row squared residual ``‖x − W Wᵀ x‖²`` off span[U, V] (the anomaly score)."""
    xc = x if mean is None else x - mean
    w = np.concatenate([u, v], axis=1)
    return np.sum((xc - (xc @ w) @ w.T) ** 2, axis=1)


def random_stiefel(rng: np.random.Generator, d: int, r: int) -> np.ndarray:
    """A uniformly random ``d × r`` orthonormal matrix (QR of a Gaussian, signs fixed)."""
    q, rr = np.linalg.qr(rng.standard_normal((d, r)))
    return q * np.where(np.diag(rr) < 0, -1.0, 1.0)


# -- the client --------------------------------------------------------------------------


@register_client
class PerPCAClient(ClientAlgorithm):
    """Global components ``U`` shared, local components ``V`` kept on the device.

    The task's ``model`` is not looked up (there is no network): any name will do,
    ``"perpca"`` by convention.  Hyperparameters: :class:`PerPCAConfig`.
    """

    name = "perpca"
    server = "perpca"
    config_cls = PerPCAConfig

    def __init__(self, spec: TaskSpec) -> None:
        # No Sequential model and no loss function: the base __init__ would build both.
        self.spec = spec
        self.config: PerPCAConfig = build_config(PerPCAConfig, algorithm_hparams(spec.hparams))

    def input_width(self) -> int | None:
        return None  # no model: the subspaces take their width from the first round's rows

    def shared_names(self) -> list[str]:
        return ["U"]

    def init_global(self, rng: np.random.Generator) -> Params:
        cfg = self.config
        return {"U": random_stiefel(rng, cfg.dim, cfg.r_global)}

    def init_local(self, rng: np.random.Generator) -> Params:
        cfg = self.config
        # Orthogonality to U is restored by the correction at the start of every round.
        return {"V": random_stiefel(rng, cfg.dim, cfg.r_local)}

    def cold_start(
        self, shared: Params, local: Params, data: Dataset, *, rng: np.random.Generator, phase: str
    ) -> Params:
        """``V`` from the deflated covariance of the first rows (module docstring)."""
        cfg = self.config
        if data.x.ndim != 2 or data.x.shape[1] != cfg.dim or len(data) == 0:
            return local  # update() reports the mismatch
        u = np.asarray(shared["U"], dtype=np.float64)
        proj = np.eye(cfg.dim) - u @ u.T
        s = proj @ covariance(np.asarray(data.x, dtype=np.float64), cfg.center) @ proj
        _, vecs = np.linalg.eigh(s)
        return {"V": vecs[:, ::-1][:, : cfg.r_local]}

    def personal_params(self, shared: Params, local: Params) -> Params:
        u = np.asarray(shared["U"], dtype=np.float64)
        return {"U": u, "V": correct_local(u, np.asarray(local["V"], dtype=np.float64))}

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
        if data.x.shape[1] != cfg.dim:
            raise ValueError(f"data have {data.x.shape[1]} features, the task says dim = {cfg.dim}")
        s = covariance(np.asarray(data.x, dtype=np.float64), cfg.center)
        u = np.asarray(shared["U"], dtype=np.float64)
        v = correct_local(u, np.asarray(local["V"], dtype=np.float64))
        # The loss at the downlinked U (after the correction): what fairness-aware
        # weightings rank devices by.
        start_loss = float(np.trace(s)) - 2.0 * objective(s, u, v)
        for _ in range(cfg.local_steps):
            u, v = stiefel_step(s, u, v, cfg.lr)
        metrics = {"train_loss": float(np.trace(s)) - 2.0 * objective(s, u, v), "start_loss": start_loss}
        return ClientResult({"U": u}, len(data), metrics), {"V": v}

    # -- scoring: there is no network, so predict/evaluate are overridden --------------
    def predict(self, shared: Params, local: Params, x: np.ndarray) -> np.ndarray:
        """The reconstruction ``W Wᵀ x`` of (centred) rows ``x`` on span[U, V]."""
        p = self.personal_params(shared, local)
        w = np.concatenate([p["U"], p["V"]], axis=1)
        return (x @ w) @ w.T

    def evaluate(self, shared: Params, local: Params, data: Dataset) -> dict[str, float]:
        """Mean squared residual off span[U, V] (centred by the rows' own mean when ``center``)."""
        x = np.asarray(data.x, dtype=np.float64)
        mean = x.mean(axis=0) if self.config.center else None
        p = self.personal_params(shared, local)
        return {"loss": float(np.mean(residual(x, p["U"], p["V"], mean)))}

"""Second-order aggregation (FedDAR eq. 8) as pure functions: no transport, no torch.

Given local heads ``w_i`` with local Hessians ``H_i`` and weights ``α_i``, eq. 8 is

    w = (Σ_i α_i H_i)⁻¹ Σ_i α_i H_i w_i,

the minimizer of ``Σ_i α_i ½ (w − w_i)ᵀ H_i (w − w_i)``.  For linear regression
heads each ``H_i ∝ Z_iᵀZ_i`` and a locally optimal ``w_i`` satisfies
``Z_iᵀZ_i w_i = Z_iᵀy_i`` (even when ``Z_iᵀZ_i`` is singular), so with
``α_i ∝ L_i`` the result is the pooled least-squares head.

The pooled matrix can be singular (a domain seen by too few samples, or by
none): :func:`psd_solve` then solves on its range and keeps a fallback (the
previous head) along the rest, instead of inverting noise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def psd_solve(h: np.ndarray, b: np.ndarray, fallback: np.ndarray, *, rcond: float = 1e-8) -> np.ndarray:
    """Solve ``h x = b`` for a symmetric positive semi-definite ``h``, safely.

    Parameters
    ----------
    h
        ``(P, P)``; symmetrized before use.
    b
        ``(P,)`` or ``(P, o)``.
    fallback
        Same shape as ``b``: the answer along directions ``h`` does not determine.
    rcond
        Eigenvalues at or below ``rcond · λ_max`` (and all non-positive ones) count as zero.

    Returns
    -------
    ndarray
        ``fallback + h⁺ (b − h·fallback)`` with ``h⁺`` the truncated pseudo-inverse: the
        exact solution when ``h`` is well conditioned, ``fallback`` where ``h`` is zero.
    """
    h = np.asarray(h, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    fallback = np.asarray(fallback, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"h must be square, got shape {h.shape}")
    if b.shape[0] != h.shape[0] or fallback.shape != b.shape:
        raise ValueError(
            f"b {b.shape} and fallback {fallback.shape} must match h {h.shape} in their first axis"
        )
    if not (np.isfinite(h).all() and np.isfinite(b).all() and np.isfinite(fallback).all()):
        raise ValueError("psd_solve got NaN or Inf")
    lam, vec = np.linalg.eigh(0.5 * (h + h.T))
    top = lam.max(initial=0.0)
    if top <= 0.0:
        return fallback.copy()
    keep = lam > rcond * top
    v = vec[:, keep]
    resid = b - h @ fallback
    coef = v.T @ resid
    coef /= lam[keep].reshape((-1,) + (1,) * (resid.ndim - 1))
    return fallback + v @ coef


class SecondOrderMean:
    """Streaming eq. 8: accumulates ``Σ α_i H_i`` and ``Σ α_i H_i w_i`` in float64.

    Memory is ``O(P²)`` whatever the number of clients, so aggregator workers can
    each sum a share and a reducer can :meth:`merge` them.
    """

    def __init__(self, dim: int) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = dim
        self.h = np.zeros((dim, dim))
        self.b = np.zeros(dim)
        self.total_weight = 0.0
        self.count = 0

    def add(self, w: np.ndarray, hessian: np.ndarray, weight: float) -> None:
        """Add one client's head ``w`` ``(P,)``, its Hessian ``(P, P)`` and its weight ``α_i >= 0``."""
        w = np.asarray(w, dtype=np.float64).reshape(-1)
        hessian = np.asarray(hessian, dtype=np.float64)
        if w.shape != (self.dim,) or hessian.shape != (self.dim, self.dim):
            raise ValueError(
                f"expected a head of {self.dim} values and a ({self.dim}, {self.dim}) Hessian, "
                f"got {w.shape} and {hessian.shape}"
            )
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        if not (np.isfinite(w).all() and np.isfinite(hessian).all()):
            raise ValueError("head or Hessian holds NaN or Inf")
        if weight == 0:
            return
        sym = 0.5 * (hessian + hessian.T)
        self.h += weight * sym
        self.b += weight * (sym @ w)
        self.total_weight += weight
        self.count += 1

    def merge(self, other: SecondOrderMean) -> None:
        """Fold in another partial sum (the reducer of a sharded aggregation)."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge dimension {other.dim} into {self.dim}")
        self.h += other.h
        self.b += other.b
        self.total_weight += other.total_weight
        self.count += other.count

    def result(self, fallback: np.ndarray, *, rcond: float = 1e-8) -> np.ndarray:
        """Eq. 8's head, or ``fallback`` (the previous head) where no client's data reaches."""
        fallback = np.asarray(fallback, dtype=np.float64).reshape(-1)
        if self.total_weight <= 0:
            return fallback.copy()
        return psd_solve(self.h / self.total_weight, self.b / self.total_weight, fallback, rcond=rcond)


def second_order_mean(
    updates: Sequence[tuple[np.ndarray, np.ndarray, float]], fallback: np.ndarray, *, rcond: float = 1e-8
) -> np.ndarray:
    """Eq. 8 over ``[(w_i, H_i, α_i), ...]``; ``fallback`` where the pooled Hessian is singular."""
    fallback = np.asarray(fallback, dtype=np.float64).reshape(-1)
    acc = SecondOrderMean(fallback.size)
    for w, hessian, weight in updates:
        acc.add(w, hessian, weight)
    return acc.result(fallback, rcond=rcond)

"""The Hessian of a linear head's mean loss in closed form (FedDAR's second-order aggregation, eq. 8).

Closed-form Hessians (eq. 8 needs them) exist for a single linear head under
MSE (``2/(n·o) · Z̃ᵀZ̃ ⊗ I_o``) and binary cross-entropy on logits
(``1/(n·o) · Σ_j z̃_j z̃_jᵀ ⊗ diag(σ(1 − σ))``), with ``Z̃ = [Z, 1]`` when the head
has a bias and parameters flattened as ``weight.ravel()`` then ``bias``.  A
domain with fewer samples than head parameters gives a singular local Hessian;
that is safe because the server solves the *pooled* system on the range of
``Σ_i L_{i,m} H_{i,m}`` and keeps the previous head along any direction no
client's data reaches (:mod:`cloud_aggregator.aggregation.second_order`).  A
domain a client lacks is skipped (count 0, zero Hessian): it weighs nothing.
"""

from __future__ import annotations

import numpy as np

from trainer_lite.layers import sigmoid

#: The losses with a closed-form head Hessian here.
HESSIAN_LOSSES = ("mse", "bce")


def linear_head_hessian(z: np.ndarray, pred: np.ndarray, loss: str, bias: bool) -> np.ndarray:
    """Hessian of a linear head's mean loss over ``n`` samples, in closed form.

    Parameters
    ----------
    z
        Encoder features ``(n, k)``.
    pred
        The head's outputs ``(n, o)`` (logits for ``"bce"``).
    loss
        ``"mse"`` (``mean (pred − y)²`` over all ``n·o`` elements) or ``"bce"``
        (binary cross-entropy on logits, averaged the same way).
    bias
        Whether the head has a bias (appends a column of ones to ``z``).

    Returns
    -------
    ndarray
        ``(P, P)`` with ``P = (k + bias)·o``, parameters flattened as
        ``weight.ravel()`` (row-major ``(k, o)``) then ``bias``, i.e. the row-major
        ravel of ``[weight; bias]``.  MSE's Hessian does not depend on the head.
    """
    n, o = pred.shape
    zt = np.hstack([z, np.ones((n, 1), dtype=z.dtype)]) if bias else z
    zt = zt.astype(np.float64, copy=False)
    if loss == "mse":
        gram = zt.T @ zt * (2.0 / (n * o))
        return gram if o == 1 else np.kron(gram, np.eye(o))
    if loss == "bce":
        s = sigmoid(pred.astype(np.float64))
        s = s * (1.0 - s)
        p = zt.shape[1]
        h = np.zeros((p * o, p * o))
        for c in range(o):
            # Output c's parameters sit at indices c, c + o, ... of the row-major ravel.
            h[c::o, c::o] = (zt * s[:, c : c + 1]).T @ zt / (n * o)
        return h
    raise ValueError(f"no closed-form head Hessian for loss {loss!r}; choose one of {list(HESSIAN_LOSSES)}")

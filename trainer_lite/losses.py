"""Losses: each returns ``(value, d value / d prediction)``, averaged over the batch as torch does.

Every loss takes ``(pred, target)`` positionally, so any of them fits
``algorithms.base.LossFn``; the options are keyword-only.  ``sample_weights``
(shape ``(batch,)``) multiplies each sample's loss before the usual average, so
all-ones weights give the plain loss; FedDAR's re-weighting ``u_m = L/(L_m·M)``
passes ``sample_weights=u[batch.domain]``.  Gradients keep ``pred``'s dtype
(float32 in, float32 out); targets are cast to it.
"""

from __future__ import annotations

import numpy as np


def _sample_weights(sample_weights: np.ndarray | None, n: int, dtype: np.dtype) -> np.ndarray | None:
    if sample_weights is None:
        return None
    w = np.asarray(sample_weights, dtype=dtype)
    if w.shape != (n,):
        raise ValueError(f"sample_weights must have shape ({n},) (one per sample), got {w.shape}")
    return w


def mse(
    pred: np.ndarray, target: np.ndarray, *, sample_weights: np.ndarray | None = None
) -> tuple[float, np.ndarray]:
    """Mean squared error over all elements (``torch.nn.MSELoss()``).

    Parameters
    ----------
    pred, target
        Arrays of the same shape ``(batch, ...)``.
    sample_weights
        Optional ``(batch,)`` weights: ``Σ_n w_n Σ_j (pred − target)²_nj / pred.size``.
    """
    if pred.shape != target.shape:
        raise ValueError(f"prediction shape {pred.shape} != target shape {target.shape}")
    diff = pred - np.asarray(target, dtype=pred.dtype)
    scale = 2.0 / diff.size
    w = _sample_weights(sample_weights, len(pred), diff.dtype)
    if w is None:
        value = float(np.vdot(diff, diff)) / diff.size
        diff *= scale
        return value, diff
    wb = w.reshape((-1,) + (1,) * (diff.ndim - 1))
    wdiff = diff * wb
    value = float(np.vdot(wdiff, diff)) / diff.size
    wdiff *= scale
    return value, wdiff


def _class_ids(target: np.ndarray, n: int, n_classes: int) -> np.ndarray:
    t = np.asarray(target)
    if t.ndim == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.shape != (n,):
        raise ValueError(f"cross_entropy needs class ids of shape ({n},) or ({n}, 1), got {t.shape}")
    if t.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy needs integer class ids, got dtype {t.dtype}; use y.astype(np.int64)")
    if n and (t.min() < 0 or t.max() >= n_classes):
        raise ValueError(f"class ids must lie in [0, {n_classes}), got min {t.min()}, max {t.max()}")
    return t


def _ce_weights(
    class_weights: np.ndarray | None,
    sample_weights: np.ndarray | None,
    t: np.ndarray,
    c: int,
    dtype: np.dtype,
) -> tuple[np.ndarray | None, float]:
    """Each sample's weight (``None``: all ones) and the divisor, as torch's weighted mean takes them."""
    n = len(t)
    w = _sample_weights(sample_weights, n, dtype)
    if class_weights is None:
        return w, float(n)
    cw = np.asarray(class_weights, dtype=dtype)
    if cw.shape != (c,):
        raise ValueError(f"class_weights must have shape ({c},), got {cw.shape}")
    wt = cw[t]
    return (wt if w is None else w * wt), float(wt.sum())


def cross_entropy(
    logits: np.ndarray,
    target: np.ndarray,
    *,
    class_weights: np.ndarray | None = None,
    sample_weights: np.ndarray | None = None,
) -> tuple[float, np.ndarray]:
    """Softmax cross-entropy over logits with integer class targets.

    Matches ``torch.nn.functional.cross_entropy(logits, target, weight=class_weights)``
    (reduction ``"mean"``), computed with the log-sum-exp shift so large logits
    neither overflow nor lose precision.

    Parameters
    ----------
    logits
        ``(batch, C)`` unnormalised scores.
    target
        ``(batch,)`` or ``(batch, 1)`` integer class ids in ``[0, C)``.
    class_weights
        Optional ``(C,)`` weights; as in torch the weighted sum is divided by
        ``Σ_n class_weights[target_n]``.
    sample_weights
        Optional ``(batch,)`` weights multiplying each sample's loss; the divisor is
        unchanged (the batch size, or the class-weight sum above).
    """
    if logits.ndim != 2:
        raise ValueError(f"cross_entropy needs logits of shape (batch, classes), got {logits.shape}")
    n, c = logits.shape
    t = _class_ids(target, n, c)
    rows = np.arange(n)
    z = logits - logits.max(axis=1, keepdims=True)
    prob = np.exp(z)
    total = prob.sum(axis=1, keepdims=True)
    nll = np.log(total[:, 0]) - z[rows, t]
    prob /= total
    prob[rows, t] -= 1.0  # softmax − one-hot
    w, denom = _ce_weights(class_weights, sample_weights, t, c, prob.dtype)
    if w is None:
        prob *= 1.0 / denom
        return float(nll.sum()) / denom, prob
    prob *= (w / denom)[:, None]
    return float(np.dot(w, nll)) / denom, prob


def _bce_target(logits: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``target`` in ``logits``' dtype and shape (a ``(batch,)`` target for ``(batch, 1)`` logits)."""
    t = np.asarray(target, dtype=logits.dtype)
    if t.shape != logits.shape:
        if logits.ndim == 2 and logits.shape[1] == 1 and t.shape == logits.shape[:1]:
            return t[:, None]
        raise ValueError(f"logits shape {logits.shape} != target shape {t.shape}")
    return t


def bce_with_logits(
    logits: np.ndarray,
    target: np.ndarray,
    *,
    pos_weight: np.ndarray | float | None = None,
    sample_weights: np.ndarray | None = None,
) -> tuple[float, np.ndarray]:
    """Binary cross-entropy on logits, averaged over all elements.

    Matches ``torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)``, using
    ``log σ(z) = −softplus(−z)`` so no sigmoid is ever rounded to 0 or 1.

    Parameters
    ----------
    logits
        ``(batch, k)`` (or ``(batch,)``) scores.
    target
        Probabilities in ``[0, 1]`` of the same shape; a ``(batch,)`` target is
        accepted for ``(batch, 1)`` logits.
    pos_weight
        Optional weight of the positive term, a scalar or one per output column.
    sample_weights
        Optional ``(batch,)`` weights multiplying each sample's loss.
    """
    t = _bce_target(logits, target)
    # softplus(−z) = log(1 + e^{−z}) = max(−z, 0) + log1p(e^{−|z|}), never overflowing.
    sp_neg = np.log1p(np.exp(-np.abs(logits)))
    sp_neg += np.maximum(-logits, 0)
    e = np.exp(-sp_neg)  # σ(z) = exp(−softplus(−z))
    if pos_weight is None:
        # ℓ = (1 − t)·z + softplus(−z);  dℓ/dz = σ(z) − t.
        loss = (1.0 - t) * logits
        loss += sp_neg
        grad = e - t
    else:
        pw = np.asarray(pos_weight, dtype=logits.dtype)
        coef = 1.0 + (pw - 1.0) * t
        # ℓ = (1 − t)·z + (1 + (p − 1)t)·softplus(−z);  dℓ/dz = σ(z)·(1 + (p − 1)t) − p·t.
        loss = (1.0 - t) * logits + coef * sp_neg
        grad = e * coef - pw * t
    size = logits.size
    w = _sample_weights(sample_weights, len(logits), grad.dtype)
    if w is not None:
        wb = w.reshape((-1,) + (1,) * (logits.ndim - 1))
        loss *= wb
        grad *= wb
    grad *= 1.0 / size
    return float(loss.sum()) / size, grad

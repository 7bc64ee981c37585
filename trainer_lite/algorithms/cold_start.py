"""Cold-start fits: a new device's personal parts fitted to its first rows through the fleet's shared parts.

Used by the algorithms' :meth:`~trainer_lite.algorithms.base.ClientAlgorithm.cold_start`
(each documents its rule).  Two fits:

:func:`fit_personal`
    ``FIT_STEPS`` optimizer steps (the algorithm's own optimizer, at its undecayed rate)
    on the personal parameters only, the shared ones frozen: a short head-only (or
    encoder-only) fit.  Under a task rate below ``FIT_LR`` (PFL-DA Table 5's 3e-3) the
    same steps also run at ``FIT_LR`` and the fit with the lower loss on the device's rows
    is kept: at 3e-3, 100 Adam steps move a parameter by at most 0.3, so a personal head
    drawn far off (FedPer's newcomer on the real printers, seed 2: test loss 15-20 at its
    first round against 0.6-0.8 for the other seeds) stayed far off for ~20 rounds.
:func:`fit_affine_encoder`
    For PFL-DA's two-number encoder ``Φ(x) = φ1·x + φ2`` (one input feature): every
    map of the rows' range ``[min x, max x]`` onto an interval ``[lo, hi]`` of a grid over
    ``[-GRID_RANGE, GRID_RANGE]`` (reversed intervals included) is scored through the
    frozen shared decoder, and the best is refined by :func:`fit_personal`.  The grid
    search is what keeps the encoder inside the region the decoder was fitted on:
    gradient steps from a random ``φ`` stall where the decoder is flat (a saturated
    sigmoid), which is how a newcomer's PFL-DA model ended up underfitting.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm
from trainer_lite.data import Dataset
from trainer_lite.layers import Affine
from trainer_lite.params import Params, copy_params, strip_prefix

#: Optimizer steps of a cold-start fit (full batches unless the task sets ``batch_size``).
FIT_STEPS = 100
#: The rate a cold-start fit also tries when the task's is lower (module docstring).
FIT_LR = 0.1
#: Half-width of the encoder-output grid the affine search maps the rows onto.
GRID_RANGE = 6.0
#: Grid points per end of the interval (``GRID_POINTS²`` candidate encoders).
GRID_POINTS = 25
#: Candidate encoders scored per decoder forward (bounds the memory of wide decoders).
_CHUNK = 64


def fit_personal(
    algo: ClientAlgorithm,
    params: Params,
    names: Sequence[str],
    data: Dataset,
    rng: np.random.Generator,
    steps: int = FIT_STEPS,
    *,
    try_fit_lr: bool = True,
) -> Params:
    """A copy of ``params`` with ``names`` trained ``steps`` steps on ``data`` (the rest frozen).

    At a task rate below ``FIT_LR`` (and ``try_fit_lr``) the fit at ``FIT_LR`` is tried too and
    the one with the lower loss on ``data`` kept (module docstring).
    """
    out = copy_params(params)
    if not (len(data) and names):
        return out
    algo.local_steps(out, data, rng, round_=1, trainable=list(names), steps=steps)
    task_lr = getattr(algo.config, "lr", None)
    if not try_fit_lr or task_lr is None or task_lr >= FIT_LR:
        return out
    fast = copy_params(params)
    algo.local_steps(
        fast,
        data,
        np.random.default_rng(rng.integers(2**63)),
        round_=1,
        trainable=list(names),
        steps=steps,
        lr=FIT_LR,
    )
    return fast if _data_loss(algo, fast, data) < _data_loss(algo, out, data) else out


def _data_loss(algo: ClientAlgorithm, params: Params, data: Dataset) -> float:
    value, _ = algo.loss(algo.model(params, data.x), data.y)
    return float(value) if np.isfinite(value) else np.inf


def affine_block(algo: ClientAlgorithm, block: str) -> bool:
    """Whether ``block`` of the algorithm's model is a one-feature :class:`Affine` encoder."""
    layer = dict(algo.model.layers).get(block)
    return isinstance(layer, Affine) and layer.dim == 1


def fit_affine_encoder(
    algo: ClientAlgorithm,
    params: Params,
    encoder_block: str,
    data: Dataset,
    rng: np.random.Generator,
) -> Params:
    """``params`` with the one-feature affine ``encoder_block`` fitted to ``data`` (module docstring).

    The current encoder is a candidate too, so the refinement starts from no worse than it.
    """
    x = np.asarray(data.x, dtype=np.float64)[:, 0]
    scale_name, shift_name = f"{encoder_block}.scale", f"{encoder_block}.shift"
    start = (
        float(np.asarray(params[scale_name]).ravel()[0]),
        float(np.asarray(params[shift_name]).ravel()[0]),
    )
    candidates = [start]
    lo_x, hi_x = float(x.min()), float(x.max())
    if hi_x > lo_x:
        grid = np.linspace(-GRID_RANGE, GRID_RANGE, GRID_POINTS)
        for lo in grid:
            for hi in grid:
                if lo != hi:
                    scale = (hi - lo) / (hi_x - lo_x)
                    candidates.append((scale, lo - scale * lo_x))
    best = min(_scores(algo, params, encoder_block, data, candidates))[1]
    out = copy_params(params)
    out[scale_name] = np.full_like(np.asarray(params[scale_name]), candidates[best][0])
    out[shift_name] = np.full_like(np.asarray(params[shift_name]), candidates[best][1])
    # The grid has placed the encoder already; a fast refinement only overfits the few rows
    # (PFL-DA's newcomer, leave-one-printer-out: round-1 median 0.19 → 0.24 with it).
    return fit_personal(algo, out, [scale_name, shift_name], data, rng, try_fit_lr=False)


def _scores(
    algo: ClientAlgorithm,
    params: Params,
    encoder_block: str,
    data: Dataset,
    candidates: list[tuple[float, float]],
) -> list[tuple[float, int]]:
    """``(loss, index)`` of every candidate ``(scale, shift)`` through the model's blocks after the encoder."""
    names = [name for name, _ in algo.model.layers]
    after = algo.model.layers[names.index(encoder_block) + 1 :]
    x = np.asarray(data.x, dtype=np.float64)[:, 0]
    out: list[tuple[float, int]] = []
    for first in range(0, len(candidates), _CHUNK):
        chunk = np.array(candidates[first : first + _CHUNK])  # (k, 2)
        h = (chunk[:, :1] * x[None, :] + chunk[:, 1:]).reshape(-1, 1).astype(np.asarray(data.x).dtype)
        for name, layer in after:
            h, _ = layer.forward(strip_prefix(params, name), h)
        pred = h.reshape(len(chunk), len(x), *h.shape[1:])
        for i in range(len(chunk)):
            value, _ = algo.loss(pred[i], data.y)
            out.append((float(value) if np.isfinite(value) else np.inf, first + i))
    return out

"""Stragglers: an upload for round r that arrives after r closed.

They are dropped by default.  With ``straggler = "next_round"`` (strategies that declare
:attr:`~cloud_aggregator.aggregation.strategies.Strategy.accepts_late_updates` and run one phase per
round) such an upload is counted once, in round r+1, when all of these hold: it quotes the
global round r started from, its device was not aggregated in round r, and the device sends
no fresh round-r+1 upload (a fresh one replaces it: one vote per device per round, which
weightings and robust reducers assume).  It enters round r+1 as ``G_r + s·(u − G_{r−1})``:
its own change, applied to the current global and shrunk by the staleness factor ``s``
(``staleness_weight``, default 0.5; FedAsync's mixing with a polynomial staleness of one
round), then weighted like any other upload.

The admission pipeline (``cloud_aggregator.rounds.admission``) decides whether an off-round upload
is a straggler of the :class:`LateWindow` and hands it over as a :class:`LateUpdate`; the
round engine turns those into ordinary uploads with :func:`absorb_late`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.types import LateUpdate, LateWindow, RoundStore
from trainer_lite.params import Params, param_hash

STRAGGLER_MODES = ("drop", "next_round")

R = TypeVar("R")


def damp_late(current: Params, base: Params, params: Params, staleness_weight: float) -> Params:
    """``current + s·(params − base)`` per name, in each array's dtype (a late upload's change, shrunk)."""
    out = {}
    for name, g in current.items():
        s = np.asarray(staleness_weight, dtype=g.dtype)
        out[name] = (g + s * (params[name].astype(g.dtype) - base[name].astype(g.dtype))).astype(g.dtype)
    return out


def absorb_late(
    replies: Sequence[R | LateUpdate],
    window: LateWindow | None,
    current: Params,
    staleness_weight: float,
) -> tuple[list[R | Update], list[str], list[str]]:
    """Turn stragglers' uploads into ordinary ones (see the module docstring).

    Parameters
    ----------
    replies
        A fleet's replies to the open round: uploads, rejections and ``LateUpdate``\\ s.
    window
        The round whose stragglers count; ``None`` counts none.
    current
        The open round's global parameters (a late change is applied to them).
    staleness_weight
        The factor ``s``.

    Returns
    -------
    replies, late, superseded
        The replies with late uploads turned into ``Update``\\ s, the devices counted late, and
        those whose late upload a fresh one replaced.
    """
    fresh = {r.device for r in replies if isinstance(r, Update)}
    out: list[R | Update] = []
    late: list[str] = []
    superseded: list[str] = []
    for r in replies:
        if not isinstance(r, LateUpdate):
            out.append(r)
            continue
        device = r.update.device
        if window is None or r.round != window.round or device in window.counted:
            continue  # not counted: admission should not have offered it
        if device in fresh:
            superseded.append(device)
            continue
        params = damp_late(current, window.global_params, r.update.params, staleness_weight)
        out.append(Update(device, params, r.update.n_samples, dict(r.update.metrics)))
        fresh.add(device)
        late.append(device)
    return out, late, superseded


def restore_late_window(
    store: RoundStore, task: str, round_: int, init_global: Callable[[], Params]
) -> LateWindow | None:
    """Round ``round_ - 1``'s window from ``store``, so stragglers still count after a restart."""
    if round_ < 2:
        return None
    records = {r.round: r for r in store.rounds(task)}
    last = records.get(round_ - 1)
    if last is None:
        return None
    if round_ - 1 == 1:
        base = init_global()
    elif round_ - 2 in records:
        base = store.get_params(records[round_ - 2].global_hash)
    else:
        return None
    return LateWindow(last.round, last.phase, param_hash(base), base, frozenset(last.participants))

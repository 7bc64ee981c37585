"""Streaming aggregation: each admitted upload folded into a running weighted sum as it arrives.

A mean-family strategy (:meth:`cloud_aggregator.aggregation.strategies.Strategy.fold`) hands the round a
:class:`RoundFold`; the fleet folds every upload admission admitted into it (a batch at a time:
:meth:`RoundFold.add_many`) and keeps only the device's sample count and metrics, so the aggregator
holds O(P) numbers per round, flat in the number of devices N.  Strategies that need every upload at once (median, trimmed mean, Krum, FedDAR-SA,
FedPP, PerPCA, DP means) return no fold and keep the whole round, O(N × P).

What "identical" means when arrival order changes
    The sum is kept in float64 with Knuth's TwoSum compensation: a second float64 array holds
    the rounding error of every addition, so the pair carries ~106 bits and the order of
    additions changes it only by about N × 2⁻¹⁰⁶ relative.  The mean is ``(sum + err) / W``
    rounded once to float64, then cast to the tensor's dtype.  For float32 tensors with integer
    weights below 2²⁹ (sample counts, or 1) every product ``w × θ`` is exact in float64, so two
    orders give bit-identical float32 results unless the exact mean lies within ~N × 2⁻⁵³ of a
    float32 rounding boundary and ~N × 2⁻¹⁰⁶ of a float64 one at once (odds ~N² × 2⁻¹³⁰ per
    coordinate: never observed, and not claimed impossible).  The same arrival order gives the
    same bits, always: a checkpoint stores both arrays exactly (:meth:`StreamingMean.state`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from cloud_aggregator.aggregation.update import Update
from ioft_protocol.state import decode_arrays, encode_arrays
from trainer_lite.params import Params

_SUM, _ERR = "sum.", "err."


def _two_sum(s: np.ndarray, x: np.ndarray, err: np.ndarray) -> None:
    """``s += x`` in place, adding the addition's exact rounding error to ``err`` (Knuth's TwoSum)."""
    x = np.broadcast_to(x, s.shape).astype(np.float64)  # a copy: _two_sum_into overwrites it
    _two_sum_into(s, x, err, np.empty_like(s), np.empty_like(s))


def _two_sum_into(
    s: np.ndarray, x: np.ndarray, err: np.ndarray, total: np.ndarray, back: np.ndarray, *, assign: bool = True
) -> None:
    """:func:`_two_sum` with no temporary array: ``x`` (the caller's scratch), ``total`` and ``back``
    are overwritten.  ``err += (s - (total - back)) + (x - back)``, operation by operation; the new
    sum is left in ``total`` and, with ``assign``, copied into ``s``."""
    np.add(s, x, out=total)
    np.subtract(total, s, out=back)
    np.subtract(x, back, out=x)  # x - back
    np.subtract(total, back, out=back)
    np.subtract(s, back, out=back)  # s - (total - back)
    back += x
    err += back
    if assign:
        s[...] = total


class StreamingMean:
    """``Σ w_i θ_i / Σ w_i`` folded one upload at a time: memory O(P), not O(N × P).

    See the module docstring for what order changes (and does not change) in the result.
    """

    def __init__(self) -> None:
        self._sum: dict[str, np.ndarray] = {}
        self._err: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, str] = {}
        self._weight = np.zeros(1)  # TwoSum pairs too: the total weight is a sum of its own
        self._weight_err = np.zeros(1)
        self.count = 0
        self._scratch: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # 3 × P float64, reused

    @property
    def total_weight(self) -> float:
        return float(self._weight[0] + self._weight_err[0])

    def add(self, params: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold ``weight × params`` in; raises ``ValueError`` naming a bad weight, name or shape."""
        self.add_many([(params, weight)])

    def add_many(self, batch: Sequence[tuple[Mapping[str, np.ndarray], float]]) -> None:
        """Fold ``(params, weight)`` pairs in, in order: the bits of :meth:`add` on each in turn, with
        the checks, scratch arrays and the weight's TwoSum (plain float arithmetic, the same IEEE
        operations) paid once per batch.  All are checked first: a bad one leaves the sum as it was.
        """
        if not batch:
            return
        first = batch[0][0]
        names = sorted(self._sum) if self.count else sorted(first)
        shapes = {n: self._sum[n].shape if n in self._sum else np.shape(first[n]) for n in names}
        for params, weight in batch:
            weight = float(weight)
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"weight must be finite and >= 0, got {weight}")
            if params.keys() != shapes.keys():  # the same names (a dict's are distinct)
                raise ValueError(f"update names {sorted(params)} differ from {names}")
            for n, v in params.items():
                shape = v.shape if type(v) is np.ndarray else np.shape(v)
                if shape != shapes[n]:
                    raise ValueError(f"{n!r} has shape {shape}, expected {shapes[n]}")
        for n in names:
            if n not in self._sum:
                v = np.asarray(first[n])
                self._sum[n] = np.zeros(v.shape, dtype=np.float64)
                self._err[n] = np.zeros(v.shape, dtype=np.float64)
                self._dtypes[n] = v.dtype.name
        weights = [float(w) for _, w in batch]
        for n in names:
            scratch = self._scratch.get(n)
            if scratch is None:
                scratch = self._scratch[n] = tuple(np.empty_like(self._sum[n]) for _ in range(3))
            x, total, back = scratch
            s, err = self._sum[n], self._err[n]
            for (params, _), w in zip(batch, weights, strict=True):
                np.multiply(params[n], w, out=x, dtype=np.float64)  # w × θ exact in float64 (docstring)
                _two_sum_into(s, x, err, total, back, assign=False)
                s, total = total, s  # the new sum is in ``total``: swap instead of copying it back
            self._sum[n] = s
            self._scratch[n] = (x, total, back)
        w_sum, w_err = float(self._weight[0]), float(self._weight_err[0])
        for w in weights:  # _two_sum on one element, in Python floats: the same IEEE operations
            total = w_sum + w
            back = total - w_sum
            w_err += (w_sum - (total - back)) + (w - back)
            w_sum = total
        self._weight[0], self._weight_err[0] = w_sum, w_err
        self.count += len(batch)

    def result(self) -> Params:
        if self.count == 0:
            raise ValueError("nothing to aggregate: no updates")
        w = self.total_weight
        if w <= 0:
            raise ValueError("total weight is zero")
        return {n: ((s + self._err[n]) / w).astype(self._dtypes[n]) for n, s in self._sum.items()}

    def merge(self, other: StreamingMean) -> None:
        """Add another partial mean's sums in (an aggregator worker's, ``cloud_aggregator.serve.workers``).

        The sums add by TwoSum and their error terms add, so the pair keeps ~106 bits: a mean
        merged from partials differs from one folded upload by upload only as another order of
        additions does (see the module docstring).
        """
        if other.count == 0:
            return
        if self.count and sorted(other._sum) != sorted(self._sum):
            raise ValueError(f"partial names {sorted(other._sum)} differ from {sorted(self._sum)}")
        for n, s in other._sum.items():
            if n not in self._sum:
                self._sum[n] = np.zeros(s.shape, dtype=np.float64)
                self._err[n] = np.zeros(s.shape, dtype=np.float64)
                self._dtypes[n] = other._dtypes[n]
            elif self._sum[n].shape != s.shape:
                raise ValueError(f"{n!r} has shape {s.shape}, expected {self._sum[n].shape}")
        for n, s in other._sum.items():
            _two_sum(self._sum[n], s, self._err[n])
            self._err[n] += other._err[n]
        _two_sum(self._weight, other._weight, self._weight_err)
        self._weight_err += other._weight_err
        self.count += other.count

    # -- checkpoints ------------------------------------------------------------------
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(arrays, meta)`` that :meth:`from_state` restores bit for bit."""
        arrays = {_SUM + n: s for n, s in self._sum.items()} | {_ERR + n: e for n, e in self._err.items()}
        arrays[_SUM] = self._weight
        arrays[_ERR] = self._weight_err
        return arrays, {"count": self.count, "dtypes": dict(self._dtypes)}

    @classmethod
    def from_state(cls, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> StreamingMean:
        out = cls()
        out.count = int(meta["count"])
        out._dtypes = dict(meta["dtypes"])
        for n in out._dtypes:
            out._sum[n] = np.array(arrays[_SUM + n], dtype=np.float64)
            out._err[n] = np.array(arrays[_ERR + n], dtype=np.float64)
        out._weight = np.array(arrays[_SUM], dtype=np.float64)
        out._weight_err = np.array(arrays[_ERR], dtype=np.float64)
        return out

    def nbytes(self) -> int:
        """Bytes the running sums hold (twice P float64s): the aggregator's per-round model memory."""
        return sum(a.nbytes for a in self._sum.values()) + sum(a.nbytes for a in self._err.values())


class RoundFold:
    """One round's fold: the strategy's per-upload weight and the running mean.

    ``devices`` lists who was folded in (so a restart refuses their re-sends as replays);
    ``pending`` those folded since the last checkpoint (:meth:`checkpointed` clears it).
    """

    def __init__(self, weight: Callable[[Update], float]) -> None:
        self.weight = weight
        self.mean = StreamingMean()
        self.devices: set[str] = set()
        self.pending: dict[str, tuple[int, dict[str, float]]] = {}

    def add(self, update: Update) -> None:
        """Fold ``update`` in; raises ``ValueError`` for a device folded already or a bad upload."""
        if update.device in self.devices:
            raise ValueError(f"{update.device!r} is folded into this round already")
        self.mean.add(update.params, float(self.weight(update)))
        self.devices.add(update.device)
        self.pending[update.device] = (update.n_samples, dict(update.metrics))

    def add_many(self, updates: Sequence[Update]) -> None:
        """Fold ``updates`` in, in order (:meth:`StreamingMean.add_many`: the bits of :meth:`add` on
        each); raises ``ValueError`` for a device folded already, or twice in ``updates``, before any is."""
        seen: set[str] = set()  # this batch's (not a copy of every device folded: O(N) a batch)
        for u in updates:
            if u.device in self.devices or u.device in seen:
                raise ValueError(f"{u.device!r} is folded into this round already")
            seen.add(u.device)
        self.mean.add_many([(u.params, float(self.weight(u))) for u in updates])
        for u in updates:
            self.devices.add(u.device)
            self.pending[u.device] = (u.n_samples, dict(u.metrics))

    def checkpoint(self) -> bytes:
        """The running sums, exactly, as bytes (``ioft_protocol.state.encode_arrays``); clears ``pending``."""
        arrays, meta = self.mean.state()
        self.pending = {}
        return encode_arrays(arrays, meta)

    def restore(self, state: bytes, devices: Iterable[str]) -> None:
        """Continue from a :meth:`checkpoint` that had folded ``devices``."""
        arrays, meta = decode_arrays(state)
        self.mean = StreamingMean.from_state(arrays, meta)
        self.devices = set(devices)
        self.pending = {}

"""The admission pipeline's steps that keep no state: the policy's bounds and one function per check
(``cloud_aggregator.rounds.admission`` runs them in order, with the state across rounds)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from cloud_aggregator.rounds.types import CollectRequest, Reason, Refusal
from ioft_protocol import codec
from ioft_protocol.codec import TensorSpec
from ioft_protocol.round_messages import UpdateMessage


@dataclass(frozen=True)
class AdmissionPolicy:
    """Bounds of the ``norm``, ``samples`` and ``metrics`` checks (see the module docstring).

    ``max_norm_ratio`` ``None`` turns the relative bound off; 1000 lets honest
    heterogeneity through (a device joining late, far from a converged fleet, may move 100×
    more than the median) and stops garbage; tighten it for a fleet known to be homogeneous.
    ``max_samples`` (a million rows: years of weld features, and still a count that cannot
    outweigh a fleet by itself at 2^62) bounds every task's ``n_samples``;
    ``task_max_samples`` sets it per task.
    """

    max_norm_ratio: float | None = 1000.0
    min_history: int = 8
    history: int = 256
    max_update_norm: float | None = None
    max_param_norm: float | None = None
    max_samples: int = 1_000_000
    task_max_samples: Mapping[str, int] = field(default_factory=dict)
    max_metrics: int = 64
    max_metric_name: int = 64

    def __post_init__(self) -> None:
        for name, value in [
            ("max_samples", self.max_samples),
            ("max_metrics", self.max_metrics),
            ("max_metric_name", self.max_metric_name),
            *((f"task_max_samples[{t!r}]", v) for t, v in self.task_max_samples.items()),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_norm_ratio is not None and not self.max_norm_ratio > 1.0:
            raise ValueError(f"max_norm_ratio must be > 1 or None, got {self.max_norm_ratio}")
        for name in ("max_update_norm", "max_param_norm"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.min_history < 1 or self.history < self.min_history:
            raise ValueError("need 1 <= min_history <= history")


try:  # np.einsum's own kernel, without its Python wrapper (~1 µs a call): the same bits
    from numpy._core.multiarray import c_einsum as _einsum
except ImportError:  # another NumPy's layout
    _einsum = np.einsum


def change_norm(params: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> float:
    """``‖params − base‖₂`` over all tensors in float64; a name ``base`` lacks counts in full."""
    total = 0.0
    for name, value in params.items():
        b = base.get(name)
        if b is not None and _shape(b) == _shape(value):
            v = np.subtract(value, b, dtype=np.float64)  # one float64 array, not three
        else:
            v = np.asarray(value, dtype=np.float64)
        flat = v.ravel()
        # einsum, not np.dot: OpenBLAS runs a long dot product on several threads, which on a busy
        # 2-core machine cost ~7 ms of CPU for P = 150k (einsum: ~0.1 ms).  Summation order differs
        # from BLAS's in the last bits; the norm only gates admission.
        total += float(_einsum("i,i->", flat, flat))
    return math.sqrt(total)


def _shape(value: object) -> tuple[int, ...]:
    """``np.shape(value)``, an array's without the call."""
    return value.shape if type(value) is np.ndarray else np.shape(value)


def param_norm(params: Mapping[str, np.ndarray]) -> float:
    """``‖params‖₂`` over all tensors in float64."""
    return change_norm(params, {})


def fingerprint(msg: UpdateMessage) -> int:
    """What tells a copy of an upload from another answer: its global, sample count, metrics
    (a device's ``train_seconds`` differs on each training) and the tensors' names, dtypes and
    shapes with up to 64 values of each.  Sampled, not all bytes (hashing 150k parameters costs
    ~1 ms an upload): it only labels an upload that is refused anyway, never admits one.

    Python's own hash of them: fingerprints are compared within this process only (admission's
    memory of who answered), never stored, and 64 bits suffice for a label (a cryptographic digest
    and the text it was fed cost ~6× more of each admitted upload).
    """
    params = msg.params
    tensors = []
    for name in sorted(params):
        value = params[name]
        flat = value.reshape(-1) if type(value) is np.ndarray else np.ravel(value)
        shape = value.shape if type(value) is np.ndarray else np.shape(value)
        tensors.append((name, flat.dtype.str, shape, flat[:: max(1, flat.size // 64)].tobytes()))
    return hash((msg.global_hash, msg.n_samples, tuple(sorted(msg.metrics.items())), tuple(tensors)))


def check_tensors(params: Mapping[str, np.ndarray], expected: Mapping[str, TensorSpec]) -> Refusal | None:
    """``ioft_protocol.codec.validate_tensors`` with its failure as a :class:`Refusal`."""
    try:
        codec.validate_tensors(params, expected)
    except codec.NonFiniteTensorError as exc:
        return Refusal(Reason.NON_FINITE, str(exc))
    except codec.WireError as exc:
        return Refusal(Reason.SHAPE_DTYPE, str(exc))
    return None


def check_layout(params: Mapping[str, np.ndarray], expected: Mapping[str, TensorSpec]) -> Refusal | None:
    """The names, shapes and dtypes half of :func:`check_tensors` (``codec.check_layout``)."""
    try:
        codec.check_layout(params, expected)
    except codec.WireError as exc:
        return Refusal(Reason.SHAPE_DTYPE, str(exc))
    return None


def check_finite(params: Mapping[str, np.ndarray]) -> Refusal | None:
    """The finiteness half of :func:`check_tensors` (``codec.check_finite``)."""
    try:
        codec.check_finite(params)
    except codec.NonFiniteTensorError as exc:
        return Refusal(Reason.NON_FINITE, str(exc))
    return None


def reported_train_rows(status: Mapping | None) -> int | None:
    """The training rows a device's status reports (``data.train``); ``None`` when it reports none."""
    data = status.get("data") if isinstance(status, Mapping) else None
    rows = data.get("train") if isinstance(data, Mapping) else None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0 else None


def check_samples(n_samples: int, cap: int, rows: int | None) -> Refusal | None:
    """``n_samples`` against the task's cap and the device's reported training rows."""
    if n_samples > cap:
        return Refusal(Reason.N_SAMPLES, f"n_samples = {n_samples} exceeds the task's max_samples = {cap}")
    if rows is not None and n_samples > rows:
        return Refusal(
            Reason.N_SAMPLES, f"n_samples = {n_samples} exceeds the {rows} training rows its status reports"
        )
    return None


def check_metrics(metrics: Mapping[str, float], policy: AdmissionPolicy) -> Refusal | None:
    """Bounded in number and name length, and finite: they land in the round record and the fleet mean."""
    if len(metrics) > policy.max_metrics:
        return Refusal(Reason.METRICS, f"{len(metrics)} metrics, at most {policy.max_metrics}")
    for name, value in metrics.items():
        if len(name) > policy.max_metric_name:
            return Refusal(
                Reason.METRICS,
                f"metric name {name[:32]!r}... of {len(name)} characters, at most {policy.max_metric_name}",
            )
        if not (math.isfinite(value) if type(value) is float else np.isfinite(value)):
            return Refusal(Reason.NON_FINITE, f"metric {name!r} is {value}")
    return None


def check_round(round_: int, phase: str, global_hash: str, request: CollectRequest) -> Refusal | None:
    """Whether the round fields name the open round, phase and starting global."""
    if round_ == request.round and phase == request.phase and global_hash == request.global_hash:
        return None  # the open round: no words to build
    quoted = f"update for round {round_}/{phase}, open: {request.round}/{request.phase}"
    if round_ < request.round:
        return Refusal(Reason.STALE_ROUND, quoted)
    if round_ > request.round:
        return Refusal(Reason.FUTURE_ROUND, quoted)
    if phase != request.phase or global_hash != request.global_hash:
        return Refusal(
            Reason.WRONG_GLOBAL,
            f"update for {round_}/{phase} from global {global_hash[:12]!r}, "
            f"open: {request.phase} from {request.global_hash[:12]!r}",
        )
    return None

"""Update admission: which decoded uploads may reach a strategy, and why the others may not.

The MQTT fleet decodes an uplink (``ioft_protocol``), then asks an :class:`Admission`
whether it is this round's, well-formed, new and of a plausible size.  A refusal is a
:class:`Refusal` with a short reason code (``REASONS``); the fleet counts it per device
and per code (``FleetView.rejected_by_reason``) and stores it in the rejections table as
``"<code>: <detail>"`` (:func:`rejection_counts_by_reason` reads it back).

Checks, in order (the first failing one names the reason):

``stale_round`` / ``future_round`` / ``wrong_global``
    The upload quotes another round, or this round but another phase or starting global.
    Stale uploads are normal after a restart; they are still counted, never aggregated.
``duplicate``
    A second upload from a device already counted this round (QoS 1 redelivery or a
    resend): the first one stands.
``not_selected``, ``shape_dtype``, ``non_finite``
    The server did not select the device; tensor names, shapes or dtypes differ from
    what the round expects; a tensor holds NaN or Inf.
``replay``
    The tensors are bit-identical to an upload already seen from *another* device, or
    from the same device in an earlier round or phase: a replayed payload carries no new
    training.  The fingerprint is over tensors only (names, dtypes, shapes, bytes) so a
    replayer cannot evade it by editing the round fields.  Uploads identical to what the
    device was sent (a device with nothing to learn from) and empty uploads are exempt.
    Fingerprints live in memory for ``AdmissionPolicy.replay_rounds`` rounds.
``norm``
    ``‖u − g‖₂`` (the change from the parameters the device was sent, over all tensors,
    in float64) above ``max_norm_ratio × r``, where ``r`` is the *median* of the last
    ``history`` accepted change norms of that task and phase (tasks train different
    models: one task's converged steps say nothing of another's first): a running
    reference that a minority of attackers cannot drag up, unlike a mean.  The relative
    bound applies once ``min_history`` norms are known and ``r > 0``.  A reference that
    refuses most of a round (an honest trajectory can speed up by orders of magnitude,
    e.g. leaving a plateau) is stale, not a majority attack: :meth:`Admission.forget_stale`
    drops it when a round would otherwise stall, and the resent uploads are judged afresh.  Optional absolute bounds
    ``max_update_norm`` (on ``‖u − g‖``) and ``max_param_norm`` (on ``‖u‖``) apply always.

The norm bound is a coarse filter against absurd uploads (×100 scaling, garbage); a
robust reducer (``cloud_aggregator.reducers``) handles subtler poisoning.  Uploads
restored from the store after a restart were admitted once and skip the replay and norm
checks, so a restarted aggregator (whose in-memory history is empty) reaches the same
decision about them.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ioft_protocol.codec import TensorSpec

if TYPE_CHECKING:  # rounds imports strategies; admission is imported by the fleet only
    from cloud_aggregator.rounds import CollectRequest
    from cloud_aggregator.store import SqliteStore

REASONS = (
    "malformed",
    "impersonation",
    "wrong_task",
    "no_round",
    "stale_round",
    "future_round",
    "wrong_global",
    "duplicate",
    "not_selected",
    "shape_dtype",
    "non_finite",
    "replay",
    "norm",
)


@dataclass(frozen=True)
class Refusal:
    """Why an upload was not admitted: ``code`` is one of ``REASONS``."""

    code: str
    detail: str

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


@dataclass(frozen=True)
class AdmissionPolicy:
    """Bounds of the ``norm`` and ``replay`` checks (see the module docstring).

    ``max_norm_ratio`` ``None`` turns the relative bound off; 1000 lets honest
    heterogeneity through (a device joining late, far from a converged fleet, may move 100×
    more than the median) and stops garbage; tighten it for a fleet known to be homogeneous.
    """

    max_norm_ratio: float | None = 1000.0
    min_history: int = 8
    history: int = 256
    max_update_norm: float | None = None
    max_param_norm: float | None = None
    replay_rounds: int = 100

    def __post_init__(self) -> None:
        if self.max_norm_ratio is not None and not self.max_norm_ratio > 1.0:
            raise ValueError(f"max_norm_ratio must be > 1 or None, got {self.max_norm_ratio}")
        for name in ("max_update_norm", "max_param_norm"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.min_history < 1 or self.history < self.min_history or self.replay_rounds < 1:
            raise ValueError("need 1 <= min_history <= history and replay_rounds >= 1")


def fingerprint(params: Mapping[str, np.ndarray]) -> str:
    """sha256 over names, dtypes, shapes and bytes (independent of dict order)."""
    h = hashlib.sha256()
    for name in sorted(params):
        arr = np.ascontiguousarray(params[name])
        h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def change_norm(params: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> float:
    """``‖params − base‖₂`` over all tensors in float64; a name ``base`` lacks counts in full."""
    total = 0.0
    for name, value in params.items():
        v = np.asarray(value, dtype=np.float64)
        b = base.get(name)
        if b is not None and np.shape(b) == v.shape:
            v = v - np.asarray(b, dtype=np.float64)
        total += float(np.dot(v.ravel(), v.ravel()))
    return float(np.sqrt(total))


def param_norm(params: Mapping[str, np.ndarray]) -> float:
    return change_norm(params, {})


def check_tensors(params: Mapping[str, np.ndarray], expected: Mapping[str, TensorSpec]) -> Refusal | None:
    """Names, shapes, dtypes, then finiteness (``ioft_protocol.codec.validate_tensors``, with reason codes)."""
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        return Refusal(
            "shape_dtype", f"tensor names differ from the round's: missing {missing}, unexpected {extra}"
        )
    for name, spec in expected.items():
        arr = params[name]
        if tuple(arr.shape) != tuple(spec.shape) or arr.dtype.name != spec.dtype:
            return Refusal(
                "shape_dtype",
                f"tensor {name!r} is {arr.dtype.name}{list(arr.shape)}, expected {spec.dtype}{list(spec.shape)}",
            )
    for name, arr in params.items():
        if not np.isfinite(arr).all():
            return Refusal("non_finite", f"tensor {name!r} holds NaN or Inf")
    return None


class Admission:
    """Stateful checks across rounds: replay fingerprints and the running norm reference."""

    def __init__(self, policy: AdmissionPolicy | None = None) -> None:
        self.policy = policy or AdmissionPolicy()
        # fingerprint -> (device, round, phase) of its first admitted upload
        self._seen: dict[str, tuple[str, int, str]] = {}
        self._norms: dict[tuple[str, str], deque[float]] = {}
        # (task, round, phase) -> devices refused by the relative bound in that round
        self._ratio_refused: dict[tuple[str, int, str], set[str]] = {}
        self._sent_hash: dict[tuple[int, str, str], str] = {}
        self._pruned_below = 0

    # -- stateless --------------------------------------------------------------------
    @staticmethod
    def check_round(round_: int, phase: str, global_hash: str, request: CollectRequest) -> Refusal | None:
        if round_ < request.round:
            return Refusal(
                "stale_round", f"update for round {round_}/{phase}, open: {request.round}/{request.phase}"
            )
        if round_ > request.round:
            return Refusal(
                "future_round", f"update for round {round_}/{phase}, open: {request.round}/{request.phase}"
            )
        if phase != request.phase or global_hash != request.global_hash:
            return Refusal(
                "wrong_global",
                f"update for {round_}/{phase} from global {global_hash[:12]!r}, "
                f"open: {request.phase} from {request.global_hash[:12]!r}",
            )
        return None

    # -- stateful ---------------------------------------------------------------------
    def _sent(self, device: str, request: CollectRequest) -> Mapping[str, np.ndarray]:
        return request.downlinks.get(device, request.global_params)

    def _sent_fingerprint(self, device: str, request: CollectRequest) -> str:
        key = (request.round, request.phase, device if device in request.downlinks else "")
        if key not in self._sent_hash:
            if len(self._sent_hash) > 4096:  # one entry per round and personalized device
                self._sent_hash.clear()
            self._sent_hash[key] = fingerprint(self._sent(device, request))
        return self._sent_hash[key]

    def check_new(
        self, device: str, params: Mapping[str, np.ndarray], request: CollectRequest
    ) -> Refusal | None:
        """``replay`` and ``norm`` (call after :func:`check_tensors` passed)."""
        p = self.policy
        if params:
            fp = fingerprint(params)
            first = self._seen.get(fp)
            if (
                first is not None
                and first != (device, request.round, request.phase)
                and fp != self._sent_fingerprint(device, request)
            ):
                who, r, ph = first
                return Refusal("replay", f"tensors identical to {who}'s upload for round {r}/{ph}")
        delta = change_norm(params, self._sent(device, request))
        if p.max_update_norm is not None and not delta <= p.max_update_norm:
            return Refusal("norm", f"‖u − g‖ = {delta:.3g} exceeds max_update_norm = {p.max_update_norm:.3g}")
        if p.max_param_norm is not None:
            norm = param_norm(params)
            if not norm <= p.max_param_norm:
                return Refusal("norm", f"‖u‖ = {norm:.3g} exceeds max_param_norm = {p.max_param_norm:.3g}")
        ref = self.reference(request.phase, request.spec.name)
        if (
            p.max_norm_ratio is not None
            and ref is not None
            and ref > 0
            and not delta <= p.max_norm_ratio * ref
        ):
            key = (request.spec.name, request.round, request.phase)
            if key not in self._ratio_refused:
                self._ratio_refused = {  # this task's earlier rounds are closed: forget them
                    k: v for k, v in self._ratio_refused.items() if k[0] != key[0] or k[1] >= request.round
                }
            self._ratio_refused.setdefault(key, set()).add(device)
            return Refusal(
                "norm",
                f"‖u − g‖ = {delta:.3g} exceeds {p.max_norm_ratio:g} × the running median {ref:.3g}",
            )
        return None

    def reference(self, phase: str, task: str) -> float | None:
        """The median of recent accepted change norms of ``task``'s ``phase``; ``None`` until ``min_history``."""
        norms = self._norms.get((task, phase))
        if not norms or len(norms) < self.policy.min_history:
            return None
        return float(np.median(np.fromiter(norms, dtype=np.float64)))

    def admitted(self, device: str, params: Mapping[str, np.ndarray], request: CollectRequest) -> None:
        """Record an admitted upload: its fingerprint and its change norm."""
        if params:
            self._seen.setdefault(fingerprint(params), (device, request.round, request.phase))
        delta = change_norm(params, self._sent(device, request))
        if np.isfinite(delta):
            key = (request.spec.name, request.phase)
            self._norms.setdefault(key, deque(maxlen=self.policy.history)).append(delta)
        horizon = request.round - self.policy.replay_rounds
        if horizon > self._pruned_below:  # at most once per round: memory stays bounded
            self._seen = {k: v for k, v in self._seen.items() if v[1] >= horizon}
            self._pruned_below = horizon

    def forget_stale(self, request: CollectRequest, admitted: int) -> bool:
        """Drop the norm reference of ``request``'s task and phase if it refused more of this round
        than was admitted; returns whether it did.  The fleet calls this when a round lacks
        participants: a reference that blocks most honest devices would stall training for good.
        """
        refused = self._ratio_refused.get((request.spec.name, request.round, request.phase), set())
        if len(refused) <= admitted:
            return False
        self._norms.pop((request.spec.name, request.phase), None)
        self._ratio_refused.pop((request.spec.name, request.round, request.phase), None)
        return True


def rejection_counts_by_reason(store: SqliteStore, task: str | None = None) -> dict[str, dict[str, int]]:
    """``{device: {reason code: count}}`` from the store's rejections table.

    Reasons are stored as ``"<code>: <detail>"``; older rows without a known code count as ``"other"``.
    """
    query = "SELECT device, reason FROM rejections"
    args: tuple = ()
    if task is not None:
        query += " WHERE task=?"
        args = (task,)
    with store._lock:  # the store keeps its connection private; this is a read under its lock
        rows = store._db.execute(query, args).fetchall()
    out: dict[str, dict[str, int]] = {}
    for device, reason in rows:
        code = reason.split(":", 1)[0]
        code = code if code in REASONS else "other"
        per = out.setdefault(device, {})
        per[code] = per.get(code, 0) + 1
    return out

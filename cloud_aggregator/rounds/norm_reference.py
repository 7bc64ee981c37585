"""The ``norm`` step's state: each task and phase's running reference of accepted change norms, the
devices its relative bound refused per round, and the sent global in float64
(``cloud_aggregator.rounds.admission`` describes the step)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping

import numpy as np

from cloud_aggregator.rounds.admission_checks import AdmissionPolicy, param_norm
from cloud_aggregator.rounds.types import CollectRequest, Reason, Refusal


class _Window:
    """The last ``size`` values, also kept sorted: the median in O(1) per upload, not a sort of
    ``size`` values (``np.median``) for every upload admitted; the same float as ``np.median``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.recent: deque[float] = deque()
        self.sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.recent)

    def append(self, value: float) -> None:
        if len(self.recent) == self.size:
            del self.sorted[bisect.bisect_left(self.sorted, self.recent.popleft())]
        self.recent.append(value)
        bisect.insort(self.sorted, value)

    def median(self) -> float:
        s, mid = self.sorted, len(self.sorted) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


class NormReference:
    """The running norm reference of one fleet's admission, across rounds."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self._norms: dict[tuple[str, str], _Window] = {}
        # (task, round, phase) -> devices refused by the relative bound in that round
        self._ratio_refused: dict[tuple[str, int, str], set[str]] = {}
        self._global64: tuple[Mapping[str, np.ndarray], dict[str, np.ndarray]] | None = None

    def add(self, task: str, phase: str, delta: float) -> None:
        """An accepted upload's change norm joins its task and phase's reference."""
        norms = self._norms.get((task, phase))
        if norms is None:
            norms = self._norms[(task, phase)] = _Window(self.policy.history)
        norms.append(delta)

    @staticmethod
    def sent(device: str, request: CollectRequest) -> Mapping[str, np.ndarray]:
        return request.downlinks.get(device, request.global_params)

    def sent64(self, device: str, request: CollectRequest) -> Mapping[str, np.ndarray]:
        """:meth:`sent` in float64, converted once per round's global, not once per upload."""
        sent = self.sent(device, request)
        if sent is not request.global_params:
            return sent  # a personal downlink: one upload uses it
        cached = self._global64
        if cached is None or cached[0] is not sent:
            cached = self._global64 = (sent, {k: np.asarray(v, dtype=np.float64) for k, v in sent.items()})
        return cached[1]

    def check(
        self, device: str, delta: float, params: Mapping[str, np.ndarray], request: CollectRequest
    ) -> Refusal | None:
        """The ``norm`` step for an upload whose change from what ``device`` was sent is ``delta``."""
        p = self.policy
        if p.max_update_norm is not None and not delta <= p.max_update_norm:
            return Refusal(
                Reason.NORM, f"‖u − g‖ = {delta:.3g} exceeds max_update_norm = {p.max_update_norm:.3g}"
            )
        if p.max_param_norm is not None:
            norm = param_norm(params)
            if not norm <= p.max_param_norm:
                return Refusal(
                    Reason.NORM, f"‖u‖ = {norm:.3g} exceeds max_param_norm = {p.max_param_norm:.3g}"
                )
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
                Reason.NORM,
                f"‖u − g‖ = {delta:.3g} exceeds {p.max_norm_ratio:g} × the running median {ref:.3g}",
            )
        return None

    def reference(self, phase: str, task: str) -> float | None:
        """The median of recent accepted change norms of ``task``'s ``phase``; ``None`` until ``min_history``."""
        norms = self._norms.get((task, phase))
        if not norms or len(norms) < self.policy.min_history:
            return None
        return float(norms.median())

    def forget_stale(self, request: CollectRequest, admitted: int) -> bool:
        """Drop the norm reference of ``request``'s task and phase if it refused more of this round
        than was admitted; returns whether it did.  The MQTT fleet calls this when a round lacks
        participants: a reference that blocks most honest devices would stall training for good.
        """
        refused = self._ratio_refused.get((request.spec.name, request.round, request.phase), set())
        if len(refused) <= admitted:
            return False
        self._norms.pop((request.spec.name, request.phase), None)
        self._ratio_refused.pop((request.spec.name, request.round, request.phase), None)
        return True

"""The round loop, written once: announce → collect → validate → aggregate → record.

Transport lives behind ``Fleet.collect`` (in-process virtual clients, or devices
over MQTT); algorithms live behind ``Strategy``.  Persistence lives behind
``RoundStore`` so that a restarted aggregator resumes from its last completed round.

Stragglers (an upload for round r that arrives after r closed) are dropped by
default.  With ``straggler="next_round"`` (FedAvg-style strategies only) such an
upload is counted once, in round r+1, when all of these hold: it quotes the global
round r started from, its device was not aggregated in round r, and the device
sends no fresh round-r+1 upload (a fresh one replaces it: one vote per device per
round, which weightings and robust reducers assume).  It enters round r+1 as
``G_r + s·(u − G_{r−1})``: its own change, applied to the current global and shrunk
by the staleness factor ``s`` (``staleness_weight``, default 0.5; FedAsync's mixing
with a polynomial staleness of one round), then weighted like any other upload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from cloud_aggregator import faults
from cloud_aggregator.strategies import Strategy, Update, make_strategy
from cloud_aggregator.strategies.fedavg import FedAvg
from ioft_protocol.codec import TensorSpec, WireError, validate_tensors
from trainer_lite.params import Params, param_hash
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)


STRAGGLER_MODES = ("drop", "next_round")


@dataclass(frozen=True)
class LateWindow:
    """The round before the open one, whose stragglers may still count (``next_round``)."""

    round: int
    phase: str
    global_hash: str  # the global that round started from: a late upload must quote it
    global_params: Params
    counted: frozenset[str]  # devices already aggregated in that round


@dataclass(frozen=True)
class LateUpdate:
    """A straggler's upload for ``LateWindow.round``, delivered while the next round is open."""

    update: Update
    round: int


@dataclass(frozen=True)
class CollectRequest:
    """What the fleet is asked for in one round and phase."""

    spec: TaskSpec
    round: int
    phase: str
    global_params: Params
    global_hash: str
    downlinks: dict[str, Params]
    expected: dict[str, TensorSpec]
    participants: tuple[str, ...] | None = None  # the server's selection; None: the fleet samples
    expected_by_device: dict[str, dict[str, TensorSpec]] = field(default_factory=dict)
    late: LateWindow | None = None  # set only when stragglers count in the next round


@dataclass(frozen=True)
class Rejection:
    """An upload that failed validation: counted per device, never aggregated."""

    device: str
    reason: str


@dataclass
class RoundRecord:
    """What happened in one round and phase (written to the store)."""

    task: str
    round: int
    phase: str
    status: str  # "completed" or "abandoned"
    participants: list[str]
    n_samples: dict[str, int]
    metrics: dict[str, dict[str, float]]
    rejected: dict[str, str]
    global_hash: str
    started: float
    finished: float
    extra: dict[str, Any] = field(default_factory=dict)

    def mean_metric(self, name: str) -> float | None:
        values = [m[name] for m in self.metrics.values() if name in m]
        return sum(values) / len(values) if values else None


class Fleet(Protocol):
    """Delivers a round to devices and returns their uploads (or rejections)."""

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection | LateUpdate]: ...


class RoundStore(Protocol):
    """Durable state: the global parameters after each completed phase."""

    def resume_point(self, task: str) -> tuple[int, int, Params, dict[str, Any]] | None:
        """``(round, phase_index, global, strategy_state)`` to start from, or ``None``."""

    def save(
        self, record: RoundRecord, next_point: tuple[int, int], global_params: Params, state: dict
    ) -> None:
        """Atomically record a finished phase and the point to resume from."""


class MemoryStore:
    """A ``RoundStore`` that keeps everything in memory (the in-process simulator)."""

    def __init__(self) -> None:
        self.records: list[RoundRecord] = []
        self._point: dict[str, tuple[int, int, Params, dict[str, Any]]] = {}

    def resume_point(self, task: str) -> tuple[int, int, Params, dict[str, Any]] | None:
        return self._point.get(task)

    def save(
        self, record: RoundRecord, next_point: tuple[int, int], global_params: Params, state: dict
    ) -> None:
        self.records.append(record)
        self._point[record.task] = (*next_point, global_params, state)


class RoundEngine:
    """Runs a task's rounds against a fleet.

    Parameters
    ----------
    spec
        The task.
    fleet
        Where rounds are delivered.
    store
        Durable state; resumed from on start.
    min_participants
        A phase with fewer valid uploads is abandoned: the global stays as it was.
    on_record
        Called with each ``RoundRecord`` as it is stored (progress tables, plots).
    straggler, staleness_weight
        ``"drop"`` or ``"next_round"`` and its factor ``s`` (see the module docstring).
    """

    def __init__(
        self,
        spec: TaskSpec,
        fleet: Fleet,
        *,
        strategy: Strategy | None = None,
        store: RoundStore | None = None,
        min_participants: int = 1,
        on_record: Callable[[RoundRecord], None] | None = None,
        straggler: str = "drop",
        staleness_weight: float = 0.5,
    ) -> None:
        if min_participants < 1:
            raise ValueError(f"min_participants must be >= 1, got {min_participants}")
        if straggler not in STRAGGLER_MODES:
            raise ValueError(f"straggler must be one of {STRAGGLER_MODES}, got {straggler!r}")
        if not 0.0 < staleness_weight <= 1.0:
            raise ValueError(f"staleness_weight must be in (0, 1], got {staleness_weight}")
        self.spec = spec
        self.fleet = fleet
        self.strategy = strategy or make_strategy(spec)
        self.store = store if store is not None else MemoryStore()
        self.min_participants = min_participants
        self.on_record = on_record
        self.straggler = straggler
        self.staleness_weight = staleness_weight
        if straggler == "next_round":
            check_next_round(self.strategy)
        self._late: LateWindow | None = None
        self.global_params: Params = {}

    def run(self) -> Params:
        """Run (or resume) until ``spec.rounds`` rounds are done; returns the final global."""
        phases = self.strategy.phases()
        point = self.store.resume_point(self.spec.name)
        if point is None:
            round_, phase_idx, self.global_params = 1, 0, self.strategy.init_global()
        else:
            round_, phase_idx, self.global_params, state = point
            self.strategy.load_state(state)
            log.info("task %s resumes at round %d phase %s", self.spec.name, round_, phases[phase_idx])
            if self.straggler == "next_round":
                self._late = self._restore_late_window(round_)
        while round_ <= self.spec.rounds:
            self.run_phase(round_, phases[phase_idx])
            phase_idx += 1
            if phase_idx == len(phases):
                round_, phase_idx = round_ + 1, 0
            self._save(round_, phase_idx)
        return self.global_params

    def run_phase(self, round_: int, phase: str) -> RoundRecord:
        started = time.time()
        gh = param_hash(self.global_params)
        expected = self.strategy.expected(self.global_params, phase)
        by_device = self.strategy.expected_by_device(self.global_params, phase)
        chosen = self.strategy.participants(round_)
        late = self._late if self._late is not None and self._late.round == round_ - 1 else None
        request = CollectRequest(
            self.spec,
            round_,
            phase,
            self.global_params,
            gh,
            self.strategy.downlinks(self.global_params),
            expected,
            participants=None if chosen is None else tuple(chosen),
            expected_by_device=by_device,
            late=late,
        )
        replies, late_devices, superseded = self.absorb_late(
            self.fleet.collect(request), request, self.staleness_weight
        )
        valid, rejected = self.validate(replies, expected, by_device, request.participants)
        status = "completed" if len(valid) >= self.min_participants else "abandoned"
        before = self.global_params
        if status == "completed":
            faults.point("before_aggregate")
            self.global_params = self.strategy.aggregate(
                self.global_params, valid, round_=round_, phase=phase
            )
            faults.point("after_aggregate")
        else:
            log.warning(
                "task %s round %d phase %s abandoned: %d valid uploads < min_participants %d",
                self.spec.name,
                round_,
                phase,
                len(valid),
                self.min_participants,
            )
        record = RoundRecord(
            task=self.spec.name,
            round=round_,
            phase=phase,
            status=status,
            participants=[u.device for u in valid],
            n_samples={u.device: u.n_samples for u in valid},
            metrics={u.device: dict(u.metrics) for u in valid},
            rejected=rejected,
            global_hash=param_hash(self.global_params),
            started=started,
            finished=time.time(),
        )
        counted = {u.device for u in valid}
        if late_devices or superseded:
            record.extra = {
                "late": sorted(counted & set(late_devices)),
                "superseded": sorted(superseded),
            }
        if self.straggler == "next_round":
            self._late = LateWindow(round_, phase, gh, before, frozenset(counted))
        self._pending = record
        return record

    def _save(self, round_: int, phase_idx: int) -> None:
        record = self._pending
        self.store.save(record, (round_, phase_idx), self.global_params, self.strategy.state())
        faults.point("after_save")
        if self.on_record is not None:
            self.on_record(record)

    def _restore_late_window(self, round_: int) -> LateWindow | None:
        """Round ``round_ - 1``'s window from the store, so stragglers still count after a restart."""
        if round_ < 2 or not hasattr(self.store, "rounds") or not hasattr(self.store, "get_params"):
            return None
        records = {r.round: r for r in self.store.rounds(self.spec.name)}
        last = records.get(round_ - 1)
        if last is None:
            return None
        if round_ - 1 == 1:
            base = self.strategy.init_global()
        elif round_ - 2 in records:
            base = self.store.get_params(records[round_ - 2].global_hash)
        else:
            return None
        return LateWindow(last.round, last.phase, param_hash(base), base, frozenset(last.participants))

    @staticmethod
    def absorb_late(
        replies: Sequence[Update | Rejection | LateUpdate], request: CollectRequest, staleness_weight: float
    ) -> tuple[list[Update | Rejection], list[str], list[str]]:
        """Turn stragglers' uploads into ordinary ones (see the module docstring).

        Returns the replies, the devices counted late, and those whose late upload a fresh one replaced.
        """
        fresh = {r.device for r in replies if isinstance(r, Update)}
        out: list[Update | Rejection] = []
        late: list[str] = []
        superseded: list[str] = []
        for r in replies:
            if not isinstance(r, LateUpdate):
                out.append(r)
                continue
            window = request.late
            device = r.update.device
            if window is None or r.round != window.round or device in window.counted:
                continue  # not counted: the fleet should not have offered it
            if device in fresh:
                superseded.append(device)
                continue
            params = damp_late(request.global_params, window.global_params, r.update.params, staleness_weight)
            out.append(Update(device, params, r.update.n_samples, dict(r.update.metrics)))
            fresh.add(device)
            late.append(device)
        return out, late, superseded

    @staticmethod
    def validate(
        replies: Sequence[Update | Rejection],
        expected: dict[str, TensorSpec],
        by_device: dict[str, dict[str, TensorSpec]] | None = None,
        participants: Sequence[str] | None = None,
    ) -> tuple[list[Update], dict[str, str]]:
        """Keep well-formed uploads, one per device; name what was wrong with the rest.

        ``by_device`` overrides ``expected`` for the devices it lists; with
        ``participants``, uploads from devices the server did not select are rejected.
        """
        by_device = by_device or {}
        selected = None if participants is None else set(participants)
        valid: dict[str, Update] = {}
        rejected: dict[str, str] = {}
        for reply in replies:
            if isinstance(reply, Rejection):
                rejected[reply.device] = reply.reason
                continue
            if reply.device in valid:
                continue  # a duplicate delivery of the same upload
            if selected is not None and reply.device not in selected:
                rejected[reply.device] = "device was not selected for this round"
                continue
            try:
                validate_tensors(reply.params, by_device.get(reply.device, expected))
            except WireError as exc:
                log.warning("rejected update from %s: %s", reply.device, exc)
                rejected[reply.device] = str(exc)
                continue
            valid[reply.device] = reply
            rejected.pop(reply.device, None)
        # A fixed order makes the floating-point sums, and so a resumed run, reproducible.
        return [valid[d] for d in sorted(valid)], rejected


def damp_late(current: Params, base: Params, params: Params, staleness_weight: float) -> Params:
    """``current + s·(params − base)`` per name, in each array's dtype (a late upload's change, shrunk)."""
    out = {}
    for name, g in current.items():
        s = np.asarray(staleness_weight, dtype=g.dtype)
        out[name] = (g + s * (params[name].astype(g.dtype) - base[name].astype(g.dtype))).astype(g.dtype)
    return out


def check_next_round(strategy: Strategy) -> None:
    """Refuse ``straggler = "next_round"`` where a late upload has no meaning."""
    if not isinstance(strategy, FedAvg) or len(strategy.phases()) != 1:
        raise ValueError(
            f"straggler = 'next_round' needs a one-phase FedAvg-style strategy (the global is a weighted "
            f"mean of uploads, so an older upload can be shrunk and mixed in); {type(strategy).__name__} "
            f"with phases {strategy.phases()} is not one: use straggler = 'drop'"
        )

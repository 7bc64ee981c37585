"""The round loop, written once: announce → collect → validate → aggregate → record.

Transport lives behind ``Fleet.collect`` (in-process virtual clients, or devices
over MQTT); algorithms live behind ``Strategy``.  Persistence lives behind
``RoundStore`` so that a restarted aggregator resumes from its last completed round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cloud_aggregator.strategies import Strategy, Update, make_strategy
from edge.wire import TensorSpec, WireError, validate_tensors
from trainer_lite.params import Params, param_hash
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)


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

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection]: ...


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
    ) -> None:
        if min_participants < 1:
            raise ValueError(f"min_participants must be >= 1, got {min_participants}")
        self.spec = spec
        self.fleet = fleet
        self.strategy = strategy or make_strategy(spec)
        self.store = store if store is not None else MemoryStore()
        self.min_participants = min_participants
        self.on_record = on_record
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
        )
        replies = self.fleet.collect(request)
        valid, rejected = self.validate(replies, expected, by_device, request.participants)
        status = "completed" if len(valid) >= self.min_participants else "abandoned"
        if status == "completed":
            self.global_params = self.strategy.aggregate(
                self.global_params, valid, round_=round_, phase=phase
            )
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
        self._pending = record
        return record

    def _save(self, round_: int, phase_idx: int) -> None:
        record = self._pending
        self.store.save(record, (round_, phase_idx), self.global_params, self.strategy.state())
        if self.on_record is not None:
            self.on_record(record)

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

"""The round loop, written once: announce → collect → aggregate → record.

Transport lives behind ``Fleet.collect`` (in-process virtual clients, or devices
over MQTT); both admit uploads through the one pipeline of ``cloud_aggregator.rounds.admission``,
so what reaches the engine is admitted already.  Algorithms live behind ``Strategy``.
Persistence lives behind ``RoundStore`` so that a restarted aggregator resumes from its
last completed round.  Stragglers are ``cloud_aggregator.rounds.stragglers``' business.

No upload counts more than the task's ``max_weight_ratio`` times the round's median sample
count (``cloud_aggregator.aggregation.weighting.cap_samples``), cut here, once, before any
strategy weighs the round; the record's ``extra["weight_cut"]`` names whom, ``{device:
[claimed, counted]}``.  A round that folds its uploads as they arrive cannot wait for its own
median: it cuts at the median of the same phase's last completed round, and the task's first
round collects its uploads whole and folds them once cut.  SecAgg rounds are bounded by their
own ``max_weight`` (the aggregator sees only the sum).  Streamed rounds split over ``[collect]
workers`` are announced with their cap (``CollectRequest.max_samples``) and each worker cuts
what it folds; their first round, with no earlier median and no whole uploads, cuts at
``max_weight_ratio`` × the median of the training rows the devices' statuses report
(``MqttFleet.reported_cap``).  The cut is counted and logged here either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from cloud_aggregator import faults
from cloud_aggregator.aggregation.strategies import Strategy, make_strategy
from cloud_aggregator.aggregation.streaming import RoundFold
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.aggregation.weighting import cap_samples, capped_weight, max_weight_ratio, sample_cap
from cloud_aggregator.rounds.stragglers import STRAGGLER_MODES, absorb_late, restore_late_window
from cloud_aggregator.rounds.task_rules import check_next_round
from cloud_aggregator.rounds.types import (
    CollectRequest,
    Fleet,
    LateWindow,
    Reason,
    Rejection,
    RoundRecord,
    RoundStore,
    SatOut,
    StoredRefusal,
    StoredUpload,
)
from ioft_protocol.downlink import quantize_global
from trainer_lite.params import Params, param_hash
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)


class MemoryStore:
    """A ``RoundStore`` that keeps everything in memory (the in-process simulator).

    Of the globals it keeps the last two per task: all a resume needs (a straggler window).
    """

    def __init__(self) -> None:
        self.records: list[RoundRecord] = []
        self._point: dict[str, tuple[int, int, Params, dict[str, Any]]] = {}
        self._params: dict[str, dict[str, Params]] = {}
        self._updates: dict[tuple[str, int, str, str], tuple[str, bytes]] = {}
        self._partials: dict[tuple[str, int, str], tuple[str, bytes, dict]] = {}
        self._rejections: list[tuple[str, str, str]] = []  # (task, device, reason code)

    def resume_point(self, task: str) -> tuple[int, int, Params, dict[str, Any]] | None:
        return self._point.get(task)

    def save(
        self, record: RoundRecord, next_point: tuple[int, int], global_params: Params, state: dict
    ) -> None:
        self.records.append(record)
        self._point[record.task] = (*next_point, global_params, state)
        kept = self._params.setdefault(record.task, {})
        kept[param_hash(global_params)] = global_params
        while len(kept) > 2:
            del kept[next(iter(kept))]
        self._updates = {
            k: v
            for k, v in self._updates.items()
            if k[0] != record.task or k[1] > record.round or (k[1] == record.round and k[2] != record.phase)
        }
        self._partials = {
            k: v
            for k, v in self._partials.items()
            if k[0] != record.task or k[1] > record.round or (k[1] == record.round and k[2] != record.phase)
        }

    def rounds(self, task: str) -> list[RoundRecord]:
        return sorted((r for r in self.records if r.task == task), key=lambda r: r.round)

    def get_params(self, digest: str) -> Params:
        for kept in self._params.values():
            if digest in kept:
                return kept[digest]
        raise KeyError(f"global {digest[:12]} is not among the last two kept per task")

    def put_update(
        self, task: str, round_: int, phase: str, device: str, global_hash: str, payload: bytes
    ) -> bool:
        key = (task, round_, phase, device)
        if key in self._updates:
            return False
        self._updates[key] = (global_hash, payload)
        return True

    def put_batch(self, updates: Sequence[StoredUpload], rejections: Sequence[StoredRefusal]) -> None:
        for row in updates:
            self.put_update(*row)
        for row in rejections:
            self.put_rejection(*row)

    def stored_updates(self, task: str, round_: int, phase: str, global_hash: str) -> list[tuple[str, bytes]]:
        return [
            (k[3], payload)
            for k, (gh, payload) in self._updates.items()
            if k[:3] == (task, round_, phase) and gh == global_hash
        ]

    def put_partial(
        self,
        task: str,
        round_: int,
        phase: str,
        global_hash: str,
        state: bytes,
        folded: dict[str, tuple[int, dict[str, float]]],
    ) -> None:
        key = (task, round_, phase)
        before = self._partials.get(key, ("", b"", {}))[2]
        self._partials[key] = (global_hash, state, {**before, **folded})
        for device in folded:
            self._updates.pop((*key, device), None)

    def partial(
        self, task: str, round_: int, phase: str, global_hash: str
    ) -> tuple[bytes, dict[str, tuple[int, dict[str, float]]]] | None:
        kept = self._partials.get((task, round_, phase))
        return None if kept is None or kept[0] != global_hash else (kept[1], dict(kept[2]))

    def put_rejection(self, task: str, round_: int | None, device: str, reason: Reason, detail: str) -> None:
        self._rejections.append((task, device, str(reason)))

    def rejection_counts(self, task: str | None = None) -> dict[str, int]:
        return {d: sum(per.values()) for d, per in self.rejection_counts_by_reason(task).items()}

    def rejection_counts_by_reason(self, task: str | None = None) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for t, device, code in self._rejections:
            if task is None or t == task:
                per = out.setdefault(device, {})
                per[code] = per.get(code, 0) + 1
        return out


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
        ``"drop"`` or ``"next_round"`` and its factor ``s`` (``cloud_aggregator.rounds.stragglers``).
    start_round
        Go on from this round when the store's point is below it (``serve --resume-from-devices``:
        the devices trained past the store), from the stored (or initial) global.
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
        start_round: int = 1,
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
        self.start_round = start_round
        self.straggler = straggler
        self.staleness_weight = staleness_weight
        if straggler == "next_round":
            check_next_round(self.strategy)
        self._late: LateWindow | None = None
        self.global_params: Params = {}
        #: The weight cap's ratio to the median (``None``: off); phase -> the last completed round's counts
        self.max_weight_ratio = None if spec.secagg is not None else max_weight_ratio(spec.server)
        self._last_samples: dict[str, list[int]] = {}

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
                self._late = restore_late_window(
                    self.store, self.spec.name, round_, self.strategy.init_global
                )
        for record in self.store.rounds(self.spec.name) if point is not None else ():
            if record.status == "completed":  # a resumed fold cuts where the first run would have
                self._last_samples[record.phase] = list(record.n_samples.values())
        if round_ < self.start_round:  # the devices ignore every round below theirs
            log.warning(
                "task %s jumps from round %d to round %d, past its devices' (the global stays the stored one)",
                self.spec.name,
                round_,
                self.start_round,
            )
            round_, phase_idx = self.start_round, 0
            self._late = None
        while round_ <= self.spec.rounds:
            if phase_idx == 0 and (why := self.strategy.stop_reason()) is not None:  # a spent ε budget
                log.warning("task %s stops before round %d: %s", self.spec.name, round_, why)
                break
            self.run_phase(round_, phases[phase_idx])
            phase_idx += 1
            if phase_idx == len(phases):
                round_, phase_idx = round_ + 1, 0
            self._save(round_, phase_idx)
        return self.global_params

    def run_phase(self, round_: int, phase: str) -> RoundRecord:
        started = time.time()
        # A compressed downlink: the phase runs on the global the devices decode, so both sides
        # hold the same bits; the store keeps the aggregate, re-quantized alike on a resume.
        down = quantize_global(self.spec.compress, self.spec.name, round_, phase, self.global_params)
        if down is not None:
            self.global_params = down[0]
        gh = param_hash(self.global_params)
        expected = self.strategy.expected(self.global_params, phase)
        by_device = self.strategy.expected_by_device(self.global_params, phase)
        chosen = self.strategy.participants(round_)
        late = self._late if self._late is not None and self._late.round == round_ - 1 else None
        # Stragglers and SecAgg rounds combine whole uploads: those rounds keep them (no fold).
        streams = self.straggler == "drop" and self.spec.secagg is None
        fold = self.strategy.fold(phase) if streams else None
        cap = None  # the most samples one upload counts, where known before the round (a fold's)
        later = None  # a fold that takes the round's uploads once they are cut
        ratio = self.max_weight_ratio
        elsewhere = getattr(self.fleet, "folds_elsewhere", False)  # workers fold: they get the cap
        if fold is not None and ratio is not None:
            if self._last_samples.get(phase):
                cap = sample_cap(self._last_samples[phase], ratio)
            elif elsewhere:  # no earlier round, and no whole uploads to wait for: the statuses' rows
                cap = self.fleet.reported_cap(ratio)
            if elsewhere and cap is None:
                ratio = None  # nothing known to cut by before the round: not cut (docs/fleet.md)
            elif cap is not None:
                fold.weight = capped_weight(fold.weight, cap)
            else:  # no earlier round to cut a streamed weight by: collect whole, fold after the cut
                later, fold = fold, None
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
            fold=fold,
            max_samples=cap if elsewhere else None,
            downlink=None if down is None else down[1],
        )
        collected = self.fleet.collect(request)
        sat_out = [r for r in collected if isinstance(r, SatOut)]
        replies, late_devices, superseded = absorb_late(
            [r for r in collected if not isinstance(r, SatOut)],
            late,
            self.global_params,
            self.staleness_weight,
        )
        valid, rejected = self.split(replies)
        claimed = {u.device: u.n_samples for u in valid}
        valid, cut = cap_samples(valid, ratio, cap)
        if later is not None:  # folded in device order below (_folded): the sums a fold would hold
            fold = later
        if cut:
            log.warning(
                "task %s round %d phase %s: %d uploads count fewer samples than they claim (at most %d, "
                "%g× the median): %s",
                self.spec.name,
                round_,
                phase,
                len(cut),
                next(iter(cut.values()))[1],
                ratio,
                ", ".join(f"{d} {c} → {k}" for d, (c, k) in sorted(cut.items())),
            )
        status = "completed" if len(valid) >= self.min_participants else "abandoned"
        before = self.global_params
        if status == "completed":
            faults.point("before_aggregate")
            if fold is not None:
                self.global_params = self.strategy.aggregate_folded(
                    self.global_params, self._folded(fold, valid), valid, round_=round_, phase=phase
                )
            else:
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
            n_samples=claimed,
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
        for note in sat_out:  # devices that sat the round out, and how it closed
            record.extra = {**record.extra, "closed": note.closed, "refused": dict(note.refused)}
            if note.holdout:
                record.extra["holdout"] = dict(note.holdout)
            if note.skipped:
                record.extra["skipped"] = dict(note.skipped)
        record.extra = {**record.extra, **self.strategy.record_extra()}  # e.g. the DP ledger's ε
        if cut:
            record.extra["weight_cut"] = {d: list(v) for d, v in sorted(cut.items())}
        if status == "completed":
            self._last_samples[phase] = list(claimed.values())
        if self.straggler == "next_round":
            self._late = LateWindow(round_, phase, gh, before, frozenset(counted))
        self._pending = record
        return record

    @staticmethod
    def _folded(fold: RoundFold, valid: Sequence[Update]) -> RoundFold:
        """``fold`` once it holds exactly ``valid``: a fleet that admits nothing through
        ``cloud_aggregator.rounds.admission`` (a test's stand-in) returns whole uploads, folded here."""
        for u in valid:
            if u.device not in fold.devices:
                fold.add(u)
        if len(fold.devices) != len(valid):
            raise ValueError(
                f"the fold holds {len(fold.devices)} uploads but the round admitted {len(valid)}: "
                "a Fleet must fold exactly the uploads it returns"
            )
        return fold

    def _save(self, round_: int, phase_idx: int) -> None:
        record = self._pending
        self.store.save(record, (round_, phase_idx), self.global_params, self.strategy.state())
        faults.point("after_save")
        if self.on_record is not None:
            self.on_record(record)

    @staticmethod
    def split(replies: Sequence[Update | Rejection]) -> tuple[list[Update], dict[str, str]]:
        """The admitted uploads in device order, and ``{device: why}`` for the rejected ones.

        Raises
        ------
        ValueError
            When the fleet returned two uploads from one device: a ``Fleet`` admits uploads
            through ``cloud_aggregator.rounds.admission``, which keeps one per device and round.
        """
        valid: dict[str, Update] = {}
        rejected: dict[str, str] = {}
        for reply in replies:
            if isinstance(reply, Rejection):
                rejected[reply.device] = reply.reason
            elif reply.device in valid:
                raise ValueError(
                    f"the fleet returned two uploads from {reply.device!r}; a Fleet admits uploads "
                    "through cloud_aggregator.rounds.admission.Admission, which keeps one per device and round"
                )
            else:
                valid[reply.device] = reply
        for device in valid:
            rejected.pop(device, None)
        # A fixed order makes the floating-point sums, and so a resumed run, reproducible.
        return [valid[d] for d in sorted(valid)], rejected

"""The coordinator of aggregator workers: ``serve`` with ``[collect] workers = K`` (K ≥ 2).

:func:`worker_fleet` is an :class:`~cloud_aggregator.serve.mqtt_fleet.MqttFleet` that reads no uplink
itself: K ``cloud-aggregator worker`` processes share it (``cloud_aggregator.serve.workers``) and send
batches, each the partial sum of the uploads a worker admitted.  The round is the fleet's own
(its ``RoundCollector``: announcements, deadlines and extensions, who is awaited, sat-out devices,
how the round closed); only the intake differs (:class:`WorkerBatches`): a batch's devices are
filed as the round's ``Update`` entries and its partial sum is merged into the round's fold
(``StreamingMean.merge``), its refusals are counted and stored as if admission had refused them
here.  A batch holding a device already counted (a device re-sent and another worker admitted the
copy) is merged nowhere: each such device is counted as a replay and the worker sends the rest again.

Losing a worker
    mosquitto (2.0.11 here) gives a killed member's unacknowledged uploads to no other member
    (eclipse-mosquitto/mosquitto#2662, and measured: README, "Aggregators that scale out"),
    and what the worker had admitted but not yet batched dies with it.  The worker's Last Will
    (its clean session ends at once on a SIGKILL: the kernel closes the socket) starts a
    barrier: every live worker is asked on ``agg/ctl`` to flush, and answers after everything
    the broker queued for it before the request.  The devices the round still awaits once
    every live worker answered and no batch came for ``SETTLE_S`` (uploads still on their way
    to the broker reach the live workers meanwhile) are sent the round's announcement on their
    own downlink (not retained); a device that answered re-sends the upload it keeps (``edge.daemon``: an
    announcement of the round it answered), one still training answers as usual and then
    re-sends once, which is counted as a routine replay.  Devices' retained statuses say
    nothing in time to tell the two apart (they are throttled to one per ``round_status_s``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import ROUND_ANSWERS, AdmissionPolicy
from cloud_aggregator.rounds.collector import CollectPolicy, RoundCollector
from cloud_aggregator.rounds.types import (
    CollectRequest,
    Reason,
    Refusal,
    RoundStore,
)
from cloud_aggregator.serve import worker_wire as wire
from cloud_aggregator.serve.mqtt_fleet import MqttFleet
from cloud_aggregator.serve.uplinks import DeviceUploads
from ioft_protocol import codec, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.round_messages import Announcement

log = logging.getLogger(__name__)

#: Seconds a round's loop waits for a message at most while a barrier may be due or answered.
BARRIER_POLL_S = 0.05
#: After a barrier: seconds with no batch merged before the devices still awaited are asked again.
SETTLE_S = 0.25


@dataclass
class _Barrier:
    seq: int
    waiting: set[str]  # live workers that have not answered it
    candidates: set[str]  # devices awaited and not counted when it began


@dataclass
class _Open:
    """A task's open round, as far as the workers' batches go."""

    request: CollectRequest
    refused: set[str] = field(default_factory=set)  # devices whose answer was refused
    barrier: _Barrier | None = None
    urgent: bool = False  # a worker died: find what it took with it
    last_merge: float = 0.0  # when a batch was last merged (monotonic)
    settling: set[str] | None = None  # a finished barrier's candidates, until batches stop coming


def worker_fleet(
    session: MqttSession,
    fleet: str,
    policy: CollectPolicy,
    store: RoundStore | None = None,
    admission: AdmissionPolicy | None = None,
    *,
    workers: int = 2,
) -> MqttFleet:
    """An ``MqttFleet`` whose uploads are admitted by ``workers`` workers (:class:`WorkerBatches`)."""
    out = MqttFleet(session, fleet, policy, store, admission)
    out.intake = WorkerBatches(out, workers)
    return out


class WorkerBatches(DeviceUploads):
    """An ``MqttFleet``'s uploads as its workers' batches; see the module docstring."""

    folds_elsewhere = True
    takes_messages = True  # workers' states and batches; devices' uploads (a worker reads them)

    def __init__(self, fleet: MqttFleet, workers: int = 2) -> None:
        super().__init__(fleet)
        self.session, self.id = fleet.session, fleet.fleet
        self.session.unsubscribe(topics.topic_up_all(self.id))  # the workers read the uplink
        self.session.subscribe(wire.topic_worker_all(self.id))
        self.session.subscribe(wire.topic_batch_all(self.id))
        self.expected_workers = workers
        self.workers: dict[str, bool] = {}  # worker -> online
        self._open: dict[str, _Open] = {}
        self._seq = 0
        #: Devices asked to re-send an upload lost with a worker, and barriers run (the ledger).
        self.nudged: list[str] = []
        self.barriers = 0

    def live_workers(self) -> set[str]:
        return {w for w, up in list(self.workers.items()) if up}

    # -- start-up ---------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Wait for the workers (an upload published while no worker subscribes reaches nobody)
        before the fleet waits for its devices."""
        fleet = self.fleet
        deadline = time.monotonic() + fleet.policy.startup_wait_s
        while len(self.live_workers()) < self.expected_workers and time.monotonic() < deadline:
            msg = self.session.get(0.1)
            if msg is not None and self.is_uplink(msg.topic):
                fleet._route(msg)  # a batch sent while we were down waits for its round, as an upload does
            elif msg is not None:
                fleet.handle(msg)
        log.info("workers online: %s", sorted(self.live_workers()))

    # -- routing: batches wait for their task's round like uploads do --------------------------
    def is_uplink(self, topic: str) -> bool:
        agg = wire.parse(topic, self.id)
        return (agg is not None and agg.kind == "batch") or DeviceUploads.is_uplink(topic)

    def route(self, msg: Message) -> str | None:
        agg = wire.parse(msg.topic, self.id)
        if agg is None or agg.kind != "batch":
            return None  # a device's upload: a worker has it (it is in the shared group too)
        if self.fleet.selections and agg.task not in self.fleet.selections:
            self.fleet.handle(msg)  # not a task of ours (its refusals are still counted)
            return None
        return agg.task

    def routes_to(self, topic: str) -> str | None:
        agg = wire.parse(topic, self.id)
        selections = self.fleet.selections
        if agg is None or agg.kind != "batch" or (selections and agg.task not in selections):
            return None
        return agg.task

    def before_next(self, task: str, timeout: float) -> float:
        self._reconcile(task)
        return min(timeout, BARRIER_POLL_S)

    @contextlib.contextmanager
    def opened(self, request: CollectRequest) -> Iterator[None]:
        if request.fold is None:
            raise ValueError(
                f"task {request.spec.name}: workers fold uploads; this round keeps every upload "
                "(a strategy that needs all updates, stragglers or SecAgg): set [collect] workers = 1"
            )
        self._open[request.spec.name] = _Open(request)
        try:
            yield
        finally:
            self._open.pop(request.spec.name, None)

    # -- messages ---------------------------------------------------------------------------
    def handle(self, msg: Message, rnd: RoundCollector | None) -> bool:
        """Take a worker's state or batch, and leave a device's upload to the workers (``True``);
        ``False``: a status, for the fleet."""
        agg = wire.parse(msg.topic, self.id)
        if agg is None:
            try:
                return topics.parse_topic(msg.topic).kind == "up"  # read by a worker
            except codec.WireError:
                return False
        if agg.kind == "worker":
            self._worker_state(agg.worker, wire.is_online(msg.payload))
        elif agg.kind == "batch":
            try:
                decoded = wire.Batch.decode(msg.payload)
            except ValueError as exc:
                log.error("unreadable batch from worker %s: %s", agg.worker, exc)
                return True
            self._batch(decoded, rnd)
        return True

    def _worker_state(self, worker: str, online: bool) -> None:
        was = self.workers.get(worker)
        self.workers[worker] = online
        if online and not was:
            log.info("worker %s online", worker)
        elif was and not online:
            log.warning("worker %s went offline; finding the uploads it took with it", worker)
            for state in list(self._open.values()):
                state.urgent = True
                if state.barrier is not None:
                    state.barrier.waiting.discard(worker)

    def _batch(self, batch: wire.Batch, rnd: RoundCollector | None) -> None:
        state = self._open.get(batch.task)
        request = None if rnd is None else rnd.request
        for task, round_, device, code, detail in batch.refused:
            reason = Reason(code) if code in Reason._value2member_map_ else Reason.OTHER
            self._refused(device, task, round_, reason, detail, rnd)
        current = (
            request is not None
            and state is not None
            and (batch.task, batch.round, batch.phase, batch.global_hash)
            == (request.spec.name, request.round, request.phase, request.global_hash)
        )
        dupes: list[str] = []
        if batch.folded and not current:  # admitted for a round closed since: too late, as one upload is
            for device in batch.folded:
                self._refused(
                    device,
                    batch.task,
                    batch.round,
                    Reason.STALE_ROUND,
                    f"admitted by worker {batch.worker} for round {batch.round}/{batch.phase} after it closed",
                    None,
                )
        elif batch.folded:
            fold = request.fold
            dupes = sorted(d for d in batch.folded if d in fold.devices)
            if dupes:
                for device in dupes:
                    self._refused(
                        device,
                        batch.task,
                        batch.round,
                        Reason.REPLAY,
                        f"device already answered round {batch.round}/{batch.phase} (worker {batch.worker})",
                        rnd,
                    )
            else:
                self._merge(batch, rnd, state)
        if batch.folded:
            ack = {"ack": batch.seq, "worker": batch.worker, "dupes": dupes}
            self.session.publish(wire.topic_ctl(self.id), wire.encode_ctl(ack), timeout=None)
        barrier = None if state is None else state.barrier
        if barrier is not None and batch.flush == barrier.seq:
            barrier.waiting.discard(batch.worker)

    def _merge(self, batch: wire.Batch, rnd: RoundCollector, state: _Open) -> None:
        """Merge ``batch``'s partial sum into the open round's fold; file its devices' uploads."""
        fold = rnd.request.fold
        fold.mean.merge(batch.mean)
        for device, (n_samples, metrics) in batch.folded.items():
            fold.devices.add(device)
            fold.pending[device] = (n_samples, metrics)
            rnd.file(device, Update(device, {}, n_samples, metrics))
            state.refused.discard(device)
        state.last_merge = time.monotonic()
        if self.fleet.store is not None and len(fold.pending) >= self.fleet.policy.checkpoint_every:
            self.fleet.ingest.checkpoint(rnd.request)

    def _refused(
        self,
        device: str,
        task: str,
        round_: int | None,
        reason: Reason,
        detail: str,
        rnd: RoundCollector | None,
    ) -> None:
        """Count and store a worker's refusal as ``MqttFleet`` counts its own; a refused answer to
        the open round is filed in it (unless the device has an admitted upload there)."""
        with self.fleet.ingest.lock:
            self.fleet.admission.count_refusal(device, reason)
        self.fleet.ingest.record_refusal(device, None, Refusal(reason, detail), answering=(task, round_))
        if (
            rnd is not None
            and reason in ROUND_ANSWERS
            and (task, round_) == (rnd.task, rnd.request.round)
            and not isinstance(rnd.inbox.get(device), Update)
        ):
            rnd.file(device, Refusal(reason, detail))  # filed as a Rejection: an answer to this round
            state = self._open.get(task)
            if state is not None:
                state.refused.add(device)

    # -- losing a worker --------------------------------------------------------------------
    def _unaccounted(self, state: _Open) -> set[str]:
        """Devices the open round awaits that no batch counted and whose answer was not refused."""
        request = state.request
        task = request.spec.name
        if self.fleet.policy.expected or request.participants is not None:
            awaited = set(request.participants or self.fleet.policy.expected)
        else:
            awaited = set(self.fleet.view.live_devices())
        selection, held_out = self.fleet.selections.get(task), set(self.fleet.holdouts.get(task, ()))
        return {
            d
            for d in awaited - request.fold.devices - state.refused - held_out
            if self.fleet.view.refusal(d, task, selection) is None
        }

    def _reconcile(self, task: str) -> None:
        """After a worker died: a barrier, then the devices still not counted are asked to re-send."""
        state = self._open.get(task)
        if state is None:
            return
        barrier, now = state.barrier, time.monotonic()
        if barrier is not None:
            if barrier.waiting & self.live_workers():
                return
            state.barrier, state.settling = None, barrier.candidates
            state.last_merge = max(state.last_merge, now)
            return
        if state.settling is not None:
            # Uploads still on their way from devices to the broker reach the live workers after
            # the barrier: wait until no batch came for SETTLE_S, or they would be asked for twice.
            if now - state.last_merge < SETTLE_S:
                return
            lost = state.settling - state.request.fold.devices - state.refused
            state.settling = None
            if lost:
                self._nudge(state.request, sorted(lost))
            return
        if not state.urgent:
            return
        live = self.live_workers()
        if not live:
            return  # nobody to flush or to take the re-sends: wait for a worker to come (back)
        state.urgent = False
        candidates = self._unaccounted(state)
        if not candidates:
            return
        self._seq += 1
        self.barriers += 1
        state.barrier = _Barrier(self._seq, set(live), candidates)
        body = {"flush": self._seq, "task": task}
        self.session.publish(wire.topic_ctl(self.id), wire.encode_ctl(body), timeout=None)

    def _nudge(self, request: CollectRequest, devices: list[str]) -> None:
        """Send each device its round's announcement on its own downlink: it re-sends its upload."""
        published = self.fleet.announcer.published.get(request.spec.name)
        if not published:
            return
        ann = Announcement.decode(published[0][1], max_bytes=self.fleet.policy.max_payload_bytes)
        log.warning(
            "round %d/%s: %d awaited devices not counted after a worker was lost; asking %s to re-send",
            request.round,
            request.phase,
            len(devices),
            devices if len(devices) <= 10 else f"{devices[:10]} and {len(devices) - 10} more",
        )
        for device in devices:
            personal = replace(ann, for_device=device)
            topic = topics.topic_down_device(self.id, request.spec.name, device)
            self.session.publish(topic, personal.encode(), timeout=None)
        self.nudged.extend(devices)

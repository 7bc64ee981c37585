"""The coordinator of aggregator workers: ``serve`` with ``[collect] workers = K`` (K ≥ 2).

:class:`WorkerFleet` is an :class:`~cloud_aggregator.serve.mqtt_fleet.MqttFleet` that reads no uplink
itself: K ``cloud-aggregator worker`` processes share it (``cloud_aggregator.serve.workers``) and send
batches, each the partial sum of the uploads a worker admitted.  The round loop is MqttFleet's
own ``collect`` (announcements, deadlines and extensions, who is awaited, sat-out devices, how
the round closed); only ``handle`` differs: a batch's devices become the round's ``Update``
entries and its partial sum is merged into the round's fold (``StreamingMean.merge``), its
refusals are counted and stored as if admission had refused them here.  A batch holding a
device already counted (a device re-sent and another worker admitted the copy) is merged
nowhere: each such device is counted as a replay and the worker sends the rest again.

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

import logging
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.aggregation.weighting import sample_cap
from cloud_aggregator.rounds.admission import ROUND_ANSWERS, AdmissionPolicy, reported_train_rows
from cloud_aggregator.rounds.types import (
    CollectRequest,
    LateUpdate,
    Reason,
    Refusal,
    Rejection,
    RoundStore,
    SatOut,
)
from cloud_aggregator.serve import worker_wire as wire
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
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


class WorkerFleet(MqttFleet):
    """``MqttFleet`` whose uploads are admitted by workers; see the module docstring."""

    #: Its workers fold the uploads: the round engine announces the weight cap with the round
    #: (``CollectRequest.max_samples``) for them to cut by (``cloud_aggregator.rounds.engine``).
    folds_elsewhere = True

    def __init__(
        self,
        session: MqttSession,
        fleet: str,
        policy: CollectPolicy,
        store: RoundStore | None = None,
        admission: AdmissionPolicy | None = None,
        *,
        workers: int = 2,
    ) -> None:
        super().__init__(session, fleet, policy, store, admission)
        session.unsubscribe(topics.topic_up_all(self.fleet))  # the workers read the uplink
        session.subscribe(wire.topic_worker_all(self.fleet))
        session.subscribe(wire.topic_batch_all(self.fleet))
        self.expected_workers = workers
        self.workers: dict[str, bool] = {}  # worker -> online
        self._open: dict[str, _Open] = {}
        self._seq = 0
        #: Devices asked to re-send an upload lost with a worker, and barriers run (the ledger).
        self.nudged: list[str] = []
        self.barriers = 0

    def reported_cap(self, ratio: float) -> int | None:
        """A first round's weight cap: ``ratio`` × the median of the training rows the devices'
        statuses report (one device claiming a million moves a median of three no further than
        an honest one); ``None`` when no status reports any."""
        rows = [r for s in list(self.view.status.values()) if (r := reported_train_rows(s)) is not None]
        return sample_cap(rows, ratio) if rows else None

    def live_workers(self) -> set[str]:
        return {w for w, up in list(self.workers.items()) if up}

    # -- start-up ---------------------------------------------------------------------------
    def wait_for_devices(self, settle_s: float = 1.0) -> list[str]:
        """Wait for the workers (an upload published while no worker subscribes reaches nobody),
        then for the devices as ``MqttFleet`` does."""
        deadline = time.monotonic() + self.policy.startup_wait_s
        while len(self.live_workers()) < self.expected_workers and time.monotonic() < deadline:
            msg = self.session.get(0.1)
            if msg is not None and self._is_uplink(msg.topic):
                self._route(msg)  # a batch sent while we were down waits for its round, as an upload does
            elif msg is not None:
                self.handle(msg, None)
        log.info("workers online: %s", sorted(self.live_workers()))
        return super().wait_for_devices(settle_s)

    # -- routing: batches wait for their task's round like uploads do --------------------------
    def _is_uplink(self, topic: str) -> bool:  # type: ignore[override]
        agg = wire.parse(topic, self.fleet)
        return (agg is not None and agg.kind == "batch") or MqttFleet._is_uplink(topic)

    def _route(self, msg: Message) -> None:
        agg = wire.parse(msg.topic, self.fleet)
        if agg is None or agg.kind != "batch":
            return  # a device's upload: a worker has it (it is in the shared group too)
        if self.selections and agg.task not in self.selections:
            self.handle(msg, None)  # not a task of ours (its refusals are still counted)
            return
        try:
            self._queue(agg.task).put_nowait(msg)
        except queue.Full:  # the worker re-sends nothing, the barrier finds the devices
            log.error("task %s: batch queue full; dropped a batch from %s", agg.task, agg.worker)

    def _routes_to(self, topic: str) -> str | None:  # type: ignore[override]
        agg = wire.parse(topic, self.fleet)
        if agg is None or agg.kind != "batch" or (self.selections and agg.task not in self.selections):
            return None
        return agg.task

    def next_message(self, task: str, timeout: float) -> Message | None:
        self._reconcile(task)
        return super().next_message(task, min(timeout, BARRIER_POLL_S))

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection | LateUpdate | SatOut]:
        if request.fold is None:
            raise ValueError(
                f"task {request.spec.name}: workers fold uploads; this round keeps every upload "
                "(a strategy that needs all updates, stragglers or SecAgg): set [collect] workers = 1"
            )
        self._open[request.spec.name] = _Open(request)
        try:
            return super().collect(request)
        finally:
            self._open.pop(request.spec.name, None)

    # -- messages ---------------------------------------------------------------------------
    def handle(self, msg: Message, request: CollectRequest | None, received: dict | None = None) -> None:
        agg = wire.parse(msg.topic, self.fleet)
        if agg is None:
            try:
                if topics.parse_topic(msg.topic).kind == "up":
                    return  # read by a worker
            except codec.WireError:
                pass
            super().handle(msg, request, received)
        elif agg.kind == "worker":
            self._worker_state(agg.worker, wire.is_online(msg.payload))
        elif agg.kind == "batch":
            try:
                batch = wire.Batch.decode(msg.payload)
            except ValueError as exc:
                log.error("unreadable batch from worker %s: %s", agg.worker, exc)
                return
            self._batch(batch, request, received if received is not None else {})

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

    def _batch(self, batch: wire.Batch, request: CollectRequest | None, received: dict) -> None:
        state = self._open.get(batch.task)
        for task, round_, device, code, detail in batch.refused:
            reason = Reason(code) if code in Reason._value2member_map_ else Reason.OTHER
            self._refused(device, task, round_, reason, detail, request, received)
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
                    {},
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
                        request,
                        received,
                    )
            else:
                fold.mean.merge(batch.mean)
                for device, (n_samples, metrics) in batch.folded.items():
                    fold.devices.add(device)
                    fold.pending[device] = (n_samples, metrics)
                    received[device] = Update(device, {}, n_samples, metrics)
                    state.refused.discard(device)
                state.last_merge = time.monotonic()
                if self.store is not None and len(fold.pending) >= self.policy.checkpoint_every:
                    self._checkpoint(request)
        if batch.folded:
            ack = {"ack": batch.seq, "worker": batch.worker, "dupes": dupes}
            self.session.publish(wire.topic_ctl(self.fleet), wire.encode_ctl(ack), timeout=None)
        barrier = None if state is None else state.barrier
        if barrier is not None and batch.flush == barrier.seq:
            barrier.waiting.discard(batch.worker)

    def _refused(
        self,
        device: str,
        task: str,
        round_: int | None,
        reason: Reason,
        detail: str,
        request: CollectRequest | None,
        received: dict,
    ) -> None:
        """Count and store a worker's refusal as ``MqttFleet`` counts its own; a refused answer to
        the open round is filed in it (unless the device has an admitted upload there)."""
        with self._admit:
            self.admission.count_refusal(device, reason)
        self._record_refusal(device, None, Refusal(reason, detail), answering=(task, round_))
        if (
            request is not None
            and reason in ROUND_ANSWERS
            and (task, round_) == (request.spec.name, request.round)
            and not isinstance(received.get(device), Update)
        ):
            received[device] = Rejection(device, f"{reason}: {detail}")
            state = self._open.get(task)
            if state is not None:
                state.refused.add(device)

    # -- losing a worker --------------------------------------------------------------------
    def _unaccounted(self, state: _Open) -> set[str]:
        """Devices the open round awaits that no batch counted and whose answer was not refused."""
        request = state.request
        task = request.spec.name
        if self.policy.expected or request.participants is not None:
            awaited = set(request.participants or self.policy.expected)
        else:
            awaited = set(self.view.live_devices())
        selection, held_out = self.selections.get(task), set(self.holdouts.get(task, ()))
        return {
            d
            for d in awaited - request.fold.devices - state.refused - held_out
            if self.view.refusal(d, task, selection) is None
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
        self.session.publish(wire.topic_ctl(self.fleet), wire.encode_ctl(body), timeout=None)

    def _nudge(self, request: CollectRequest, devices: list[str]) -> None:
        """Send each device its round's announcement on its own downlink: it re-sends its upload."""
        published = self._announced.get(request.spec.name)
        if not published:
            return
        ann = Announcement.decode(published[0][1], max_bytes=self.policy.max_payload_bytes)
        log.warning(
            "round %d/%s: %d awaited devices not counted after a worker was lost; asking %s to re-send",
            request.round,
            request.phase,
            len(devices),
            devices if len(devices) <= 10 else f"{devices[:10]} and {len(devices) - 10} more",
        )
        for device in devices:
            personal = replace(ann, for_device=device)
            topic = topics.topic_down_device(self.fleet, request.spec.name, device)
            self.session.publish(topic, personal.encode(), timeout=None)
        self.nudged.extend(devices)

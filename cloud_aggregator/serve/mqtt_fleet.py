"""The fleet over MQTT: announce a round (retained), collect uploads until every
expected device answered or the deadline passed.

The fleet pumps and routes: each round's waiting (whom it awaits, its deadline and extensions,
when it closes) is its :class:`~cloud_aggregator.rounds.collector.RoundCollector`; the uplinks come
through its intake and each task's queue (:mod:`cloud_aggregator.serve.uplinks`), the
announcements go out through :mod:`cloud_aggregator.serve.announcer`.

Every uplink goes through the admission pipeline (``cloud_aggregator.rounds.admission``), the
same one the in-process simulator runs: decoded only after its size is checked, its
topic's device must be the device named inside, it must be for this fleet, task, round,
phase and the global the round started from, and so on.  A refused one is logged with
the device id, counted per reason and stored: a malformed payload never stops a round.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from cloud_aggregator import faults
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.aggregation.weighting import sample_cap
from cloud_aggregator.rounds.admission import Admission, AdmissionPolicy, reported_train_rows
from cloud_aggregator.rounds.collector import NAMED, CollectPolicy, RoundCollector, unconfirmed
from cloud_aggregator.rounds.ingest import INGEST_BYTES, INGEST_MAX, Ingest, Upload
from cloud_aggregator.rounds.types import (
    CollectRequest,
    LateUpdate,
    Rejection,
    RoundStore,
    SatOut,
)
from cloud_aggregator.serve.announcer import Announcer
from cloud_aggregator.serve.fleet_scaling import ScalingPool
from cloud_aggregator.serve.liveness import Liveness
from cloud_aggregator.serve.roster import DeviceRoster, LatestStatus
from cloud_aggregator.serve.uplinks import DeviceUploads, TaskQueues, parse_topic
from ioft_protocol import codec, round_messages, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.round_messages import DeviceSelection

log = logging.getLogger(__name__)

#: Queued messages handled at most between two looks at who is still awaited (wait_for_devices).
BATCH = 2000
#: Seconds of messages a round handles between two looks at who is still awaited.
RECHECK_S = 0.05


class MqttFleet:
    """A ``Fleet`` whose devices are ``edge-trainer`` processes reached through a broker."""

    def __init__(
        self,
        session: MqttSession,
        fleet: str,
        policy: CollectPolicy,
        store: RoundStore | None = None,
        admission: AdmissionPolicy | None = None,
    ):
        self.session = session
        self.fleet = codec.check_id("fleet", fleet)
        self.policy = policy
        self.store = store
        #: Where rounds get their uploads: the devices' own here; workers' batches (``coordinator``).
        self.intake: DeviceUploads = DeviceUploads(self)
        statuses: dict[str, dict] = {}  # the roster's, read by admission (reported training rows)
        self.admission = Admission(
            self.fleet,
            admission,
            max_payload_bytes=policy.max_payload_bytes,
            statuses=statuses,
        )
        self.view = DeviceRoster(
            status=statuses, rejected_by_reason=self.admission.refused, liveness=Liveness(policy.liveness_s)
        )
        #: task -> the devices its rounds skipped as not live, as last logged (said again on a change)
        self._skipped: dict[str, tuple[str, ...]] = {}
        self.queues = TaskQueues(self)  # each task's uplinks, for its collecting thread
        #: admitted, stored, folded and filed: every upload of every task (its lock: admission's counts)
        self.ingest = Ingest(self.admission, store, policy.checkpoint_every)
        #: task -> which devices run it (``[[task]] devices``); absent: every device.
        self.selections: dict[str, DeviceSelection | None] = {}
        #: task -> its held-out devices (``[[task]] holdout``): they score the global, never train.
        self.holdouts: dict[str, tuple[str, ...]] = {}
        #: task -> the last "cannot reach min_participants" it logged: said once, again only on a change
        self._short: dict[str, tuple] = {}
        # Statuses at QoS 0: they are state (the next one, or the retained one after a reconnect,
        # says the same), and a device flooding them then fills the broker's QoS 0 allowance for
        # us, where the broker drops the excess, instead of its QoS 1 queue, which it shares with
        # the uploads (mosquitto drops those too once max_queued_messages is reached).  No PUBACK
        # per status either.
        session.subscribe(topics.topic_status_all(self.fleet), qos=0)
        session.subscribe(topics.topic_up_all(self.fleet))
        self.scaling = self._scaling_pool()
        self.announcer = Announcer(session, self.fleet)  # it publishes them again on a reconnect
        # Retained statuses may not reach us (ioft_protocol.restate): ask every device for its own.
        self._roll_called = float("-inf")  # monotonic time of the last roll call
        session.on_connect_hooks.append(self._roll_call)  # and wait_for_devices() calls it at start
        self.statuses = LatestStatus(session)  # a newer status replaces a queued one's payload
        if hasattr(session, "tap") and hasattr(session, "inbound"):
            session.tap(topics.topic_status_all(self.fleet), self.statuses.absorb)

    def _scaling_pool(self) -> ScalingPool:
        """Tasks with scaling = "fleet": the devices' feature statistics, pooled once (fleet_scaling)."""
        policy = self.admission.policy
        pool = ScalingPool(
            self.fleet,
            lambda topic, payload: self.session.publish(topic, payload, retain=True, timeout=None),
            self._scaling_refusal,
            lambda device: reported_train_rows(self.view.status.get(device)),
            lambda task: policy.task_max_samples.get(task, policy.max_samples),
        )
        self.session.subscribe(topics.topic_stats_all(self.fleet))
        self.session.on_connect_hooks.append(pool.republish)
        return pool

    @property
    def folds_elsewhere(self) -> bool:
        """Whether workers fold the uploads: the round engine announces the weight cap with the round
        (``CollectRequest.max_samples``) for them to cut by (``cloud_aggregator.rounds.engine``)."""
        return self.intake.folds_elsewhere

    def reported_cap(self, ratio: float) -> int | None:
        """A first round's weight cap: ``ratio`` × the median of the training rows the devices'
        statuses report (one device claiming a million moves a median of three no further than
        an honest one); ``None`` when no status reports any."""
        rows = [r for s in list(self.view.status.values()) if (r := reported_train_rows(s)) is not None]
        return sample_cap(rows, ratio) if rows else None

    def _scaling_refusal(self, task: str, device: str) -> str | None:
        """Why ``device`` may not add its statistics to ``task``'s fleet scaling (``None``: it may)."""
        if device in self.holdouts.get(task, ()):
            return "the device is held out of the task"
        return self.view.outside(device, self.selections.get(task))

    def _roll_call(self) -> None:
        self._roll_called = time.monotonic()
        self.session.publish(topics.topic_roll_call(self.fleet), b"", timeout=None)

    # -- announcing ---------------------------------------------------------------
    def announce(
        self, request: CollectRequest, deadline: float, state: str = "running", mode: str = "sync"
    ) -> None:
        """Publish (retained) ``request``'s announcement; ``mode = "buffered"``: a FedBuff version
        (``cloud_aggregator.serve.buffered_mqtt``), not a round to answer once."""
        spec = request.spec
        self.scaling.task(spec)
        ann = round_messages.Announcement(
            fleet=self.fleet,
            task=spec.name,
            round=request.round,
            phase=request.phase,
            spec=spec.to_json(),
            deadline=deadline,
            global_hash=request.global_hash,
            state=state,
            # compressed: the codes of request.global_params, which is what they decode to
            params=request.global_params if request.downlink is None else request.downlink[0],
            personalized=tuple(request.downlinks),
            participants=request.participants,
            devices=self.selections.get(spec.name),
            holdout=self.holdouts.get(spec.name, ()),
            mode=mode,
            max_samples=request.max_samples,
            downlink=None if request.downlink is None else request.downlink[1],
        )
        self.announcer.publish(ann, request.downlinks)

    def finish(self, request: CollectRequest) -> None:
        """Announce that the task is done (retained), with the final global parameters."""
        self.announce(request, deadline=time.time(), state="done")

    # -- collecting -------------------------------------------------------------------
    def wait_for_devices(self, settle_s: float = 1.0) -> list[str]:
        """Block until enough devices are online (or the start-up wait passes); the devices online.

        Once enough are, statuses are still read until no device came online (live) for
        ``settle_s``, so a device that connects a moment later is counted too (roll-call answers
        come in a burst).  Statuses of devices already counted (heartbeats) do not prolong it.
        """
        self.intake.wait_ready()
        self._roll_call()  # statuses retained where the broker keeps none for us come as answers
        want = set(self.policy.expected) or None
        need = len(want) if want else self.policy.min_participants
        deadline = time.monotonic() + self.policy.startup_wait_s
        quiet_since: float | None = None
        counted = -1
        while time.monotonic() < deadline:
            online = set(self.view.live_devices())
            if len(online) != counted:  # a device came (or went): wait for the burst to end
                counted, quiet_since = len(online), None
            if (want and want <= online) or (not want and len(online) >= need):
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= settle_s:
                    break
            msg, handled = self.session.get(0.1), 0
            while msg is not None:  # a burst is read before the O(N) look above (O(N²) per message)
                if self._is_uplink(msg.topic):
                    # Uplinks the broker queued for our persistent session while we were down: the
                    # task's first round collected is the one they answer, so they wait for it.
                    self._route(msg)
                else:
                    self.handle(msg, None)
                handled += 1
                msg = self.session.get(0) if handled < BATCH else None
        return self.view.live_devices()

    def _is_uplink(self, topic: str) -> bool:
        """Whether ``topic`` is an uplink: routed to its task's queue (:attr:`intake`)."""
        return self.intake.is_uplink(topic)

    def _route(self, msg: Message) -> None:
        """Queue an uplink for its task's thread (:attr:`intake` says which, or drops it)."""
        self.queues.route(msg)

    def next_message(self, task: str, timeout: float) -> Message | None:
        """The next message for ``task``'s round: an uplink of the task, or a status (:class:`TaskQueues`)."""
        return self.queues.next_message(task, timeout)

    # -- a round ----------------------------------------------------------------------
    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection | LateUpdate | SatOut]:
        """Announce ``request``'s round and pump messages into its collector until it closes."""
        with self.intake.opened(request):
            return self._collect(request)

    def _collect(self, request: CollectRequest) -> list[Update | Rejection | LateUpdate | SatOut]:
        rnd = self.round_collector(request)
        self.ingest.restore(rnd)
        rnd.open()
        if not rnd.fixed:
            self._say_skipped(request)
        self.announce(request, rnd.deadline)
        faults.point("after_announce")
        while (step := rnd.step()) not in ("answered", "deadline"):
            if step == "extend":
                self._extend(rnd)
            self._take_messages(rnd)
            rnd.look()  # statuses may have come through another task's thread too
        return rnd.outcome()

    def round_collector(self, request: CollectRequest) -> RoundCollector:
        """A collector for ``request``'s round over this fleet's roster, selection and held-out devices."""
        task = request.spec.name
        return RoundCollector(
            request,
            self.policy,
            self.view,
            selection=self.selections.get(task),
            held_out=self.holdouts.get(task, ()),
            said_short=self._short,
        )

    def _extend(self, rnd: RoundCollector) -> None:
        """Too few valid uploads at the deadline: drop a stale norm reference and re-announce."""
        with self.ingest.lock:
            stale = self.admission.forget_stale(rnd.request, len(rnd.inbox.answered))
        if stale:
            log.warning(
                "round %d: the norm reference refused most uploads; it is stale, dropping it "
                "so the resent uploads are judged afresh",
                rnd.request.round,
            )
        self.announce(rnd.request, rnd.deadline)

    def _take_messages(self, rnd: RoundCollector) -> None:
        """Handle messages for up to ``RECHECK_S`` before the collector's O(N) looks (once per message
        they cost O(N²) per round at thousands of devices), or until the last awaited may be in.
        Uploads are ingested in batches: whatever waited in the queue (:meth:`Ingest.take <cloud_aggregator.rounds.ingest.Ingest.take>`)."""
        task = rnd.task
        msg = self.next_message(task, min(0.2, rnd.left()))
        until = time.monotonic() + RECHECK_S
        batch: list[Upload] = []
        try:
            while msg is not None:
                self.handle(msg, rnd, batch)
                left = min(until - time.monotonic(), rnd.left())
                if len(rnd.inbox) + len(batch) >= len(rnd.expected) or left <= 0:
                    break
                msg = self.next_message(task, 0.0)
                if msg is None:  # nothing waits: what came is stored and counted before waiting on
                    self._flush(rnd, batch)
                    if len(rnd.inbox) >= len(rnd.expected):
                        break
                    msg = self.next_message(task, left)
        finally:
            self._flush(rnd, batch)

    def _say_skipped(self, request: CollectRequest) -> None:
        """One line naming the devices a round does not wait for as not live (again only on a change),
        and a roll call for them."""
        skipped = unconfirmed(self.view)
        if skipped and time.monotonic() - self._roll_called >= self.policy.liveness_s:
            # Devices too old for a heartbeat still answer the roll call (at most one a liveness_s,
            # so a ghost costs the fleet one status per device that often): one that answers is
            # awaited from then on, this round included.
            self._roll_call()
        task = request.spec.name
        key = tuple(skipped)
        if self._skipped.get(task, ()) == key:
            return
        self._skipped[task] = key
        if not skipped:
            log.info("task %s round %d: every device online was heard live", task, request.round)
            return
        named = list(skipped)[:NAMED]
        more = f" and {len(skipped) - NAMED} more" if len(skipped) > NAMED else ""
        log.warning(
            "task %s round %d: not waiting for %d device(s) that say online but were not heard live "
            "(no heartbeat or roll-call answer within [collect] liveness_s = %g s; one that answers the "
            "roll call is awaited): %s%s",
            task,
            request.round,
            len(skipped),
            self.policy.liveness_s,
            "; ".join(f"{d} ({skipped[d]})" for d in named),
            more,
        )

    # -- messages ---------------------------------------------------------------------
    def handle(
        self,
        msg: Message,
        rnd: RoundCollector | None = None,
        batch: list[Upload] | None = None,
    ) -> None:
        """Keep a status, or admit an upload into ``rnd`` (``None``: no round open, it is refused);
        with ``batch``, uploads wait there to be ingested together (:meth:`_flush`)."""
        if self.intake.takes_messages and self.intake.handle(msg, rnd):
            return
        try:
            topic = parse_topic(msg.topic)
        except codec.WireError as exc:
            log.warning("ignored message on unexpected topic %r: %s", msg.topic, exc)
            return
        if topic.fleet != self.fleet:
            return
        if topic.kind == "status":
            if batch:  # uploads read before it are judged on the status they saw
                self._flush(rnd, batch)
            msg = self.statuses.latest(msg)
            self._status(topic.device, msg.payload, live=not msg.retain)
        elif topic.kind == "stats":
            self.scaling.handle(str(topic.task), str(topic.device), msg.payload)
        elif topic.kind == "up" and rnd is None:
            self.ingest.take(None, [(topic.device, msg.payload, None, False)])
        elif topic.kind == "up" and topic.task == rnd.task:
            selection = self.selections.get(topic.task)
            outside = None if selection is None else self.view.outside(topic.device, selection)
            held_out = topic.device in self.holdouts.get(topic.task, ())
            upload = (topic.device, msg.payload, outside, held_out)
            if batch is None:
                self.ingest.take(rnd, [upload])
                return
            batch.append(upload)
            if len(batch) >= min(INGEST_MAX, max(1, INGEST_BYTES // max(1, len(msg.payload)))):
                self._flush(rnd, batch)

    def _status(self, device: str, payload: bytes, live: bool = True) -> None:
        try:
            status = json.loads(payload)
            if not isinstance(status, dict):
                raise ValueError("status must be a JSON object")
        except ValueError as exc:
            log.warning("bad status from %s: %s", device, exc)
            return
        self.announcer.restate(device, status)
        self.view.take(device, status, live)

    def _flush(self, rnd: RoundCollector | None, batch: list[Upload]) -> None:
        """Ingest the uploads ``batch`` holds back, if any."""
        if batch:
            uploads = batch[:]
            batch.clear()
            self.ingest.take(rnd, uploads)

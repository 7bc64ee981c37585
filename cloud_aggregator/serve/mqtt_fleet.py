"""The fleet over MQTT: announce a round (retained), collect uploads until every
expected device answered or the deadline passed.

Tasks may collect side by side, each on its own thread, over the one session: whichever
collecting thread holds the pump reads the session, keeps the statuses and hands each
uplink to its task's queue (:meth:`MqttFleet.next_message`), so no thread is added and one task
alone reads the session as it always did.

Every uplink goes through the admission pipeline (``cloud_aggregator.rounds.admission``), the
same one the in-process simulator runs: decoded only after its size is checked, its
topic's device must be the device named inside, it must be for this fleet, task, round,
phase and the global the round started from, and so on.  A refused one is logged with
the device id, counted per reason and stored: a malformed payload never stops a round.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cloud_aggregator import faults
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import Admission, AdmissionPolicy, Inbox, filing, reported_train_rows
from cloud_aggregator.rounds.types import (
    CollectRequest,
    LateUpdate,
    Reason,
    Refusal,
    Rejection,
    RoundStore,
    SatOut,
    StoredRefusal,
    StoredUpload,
)
from cloud_aggregator.serve.fleet_scaling import ScalingPool
from cloud_aggregator.serve.liveness import Liveness
from ioft_protocol import codec, restate, round_messages, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.mqtt_options import MqttError
from ioft_protocol.round_messages import DeviceSelection, HoldoutScore
from trainer_lite.params import param_hash

log = logging.getLogger(__name__)

#: Refusals that are the protocol at work, logged at INFO (counted and stored like any other): a
#: device re-sending an upload already counted (after an aggregator restart it re-sends its answer
#: to the round it sees re-announced, which may close on the stored copy before the re-send
#: lands; ``resent`` where it is a copy of the counted one), or answering a round already closed.
ROUTINE_REFUSALS = frozenset({Reason.REPLAY, Reason.STALE_ROUND, Reason.RESENT})
#: Queued messages handled at most between two looks at who is still awaited (wait_for_devices).
BATCH = 2000
#: Seconds of messages a round handles between two looks at who is still awaited.
RECHECK_S = 0.05
#: Uploads ingested together at most (:meth:`MqttFleet._ingest`: one transaction, one fold), and
#: their payload bytes at most: a batch is whatever waited in the queue, up to these.
INGEST_MAX, INGEST_BYTES = 512, 32 * 1024 * 1024
#: A topic is parsed once per device, not three times per message (routing, the task's queue, handling).
parse_topic = functools.lru_cache(maxsize=1 << 15)(topics.parse_topic)
#: Seconds an announcement waits for the broker's ack (a crash right after it must not lose it);
#: without one the round goes on: the broker gets it once the connection is back.
ANNOUNCE_ACK_S = 10.0


@dataclass
class CollectPolicy:
    """How long to wait and for whom.

    ``expected`` lists the devices a round waits for; empty means "whoever is
    online", which a device joins by coming online and leaves by going offline
    mid-round.  A round ends when all expected devices answered with at least
    ``min_participants`` valid uploads, or when ``deadline_s`` passed; with fewer
    than ``min_participants`` valid uploads by then the deadline is extended (and
    the round re-announced) up to ``max_extensions`` times, after which the round
    engine abandons it.  Before the first round the fleet waits up to
    ``startup_wait_s`` for ``min_participants`` (or all expected) devices to come online.
    """

    deadline_s: float = 30.0
    min_participants: int = 1
    max_extensions: int = 2
    expected: tuple[str, ...] = ()
    startup_wait_s: float = 60.0
    max_payload_bytes: int = codec.MAX_PAYLOAD_BYTES
    #: A streaming round (``cloud_aggregator.aggregation.streaming``) checkpoints its partial sum after this
    #: many admitted uploads and drops their stored payloads: a restart resumes from the
    #: checkpoint plus at most this many stored uploads.
    checkpoint_every: int = 256
    #: Without ``expected``, rounds wait only for devices heard live (a status sent while this
    #: aggregator listened) within this many seconds, and name the others (:mod:`.liveness`); 0: off.
    liveness_s: float = 0.0


#: What the aggregator reads of a device's retained status (the rest is the console's, which
#: reads the broker itself): 10,000 whole statuses would be tens of MB of parsed JSON.
KEPT_STATUS = ("state", "kind", "tags", "refused", "holdout", "data", "ahead_of_aggregator")
#: Devices named in one "waiting for" log line; the rest are counted.
NAMED = 20


class _Inbox(dict):
    """A round's inbox (``admission.Inbox``) that knows which devices have an admitted ``Update``,
    so a round's loop asks ``answered`` in O(1) instead of scanning N entries every turn."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: set[str] = set()
        #: Uploads read but not yet ingested (``None``: each is ingested as it is handled).
        self.batch: list[tuple[str, bytes, str | None, bool]] | None = None

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if isinstance(value, Update):
            self.answered.add(key)
        else:
            self.answered.discard(key)


@dataclass
class DeviceRoster:
    """What the aggregator knows of each device (from retained status messages); the console's picture
    of the fleet is ``cloud_aggregator.console.fleet_view.FleetView``."""

    online: dict[str, bool] = field(default_factory=dict)
    #: device -> the fields of its status the aggregator reads (:data:`KEPT_STATUS`)
    status: dict[str, dict] = field(default_factory=dict)
    #: device -> reason -> count: the fleet's ``Admission.refused``
    rejected_by_reason: dict[str, dict[Reason, int]] = field(default_factory=dict)
    #: statuses taken in so far: a round re-reads the O(N) view only when this moved
    changes: int = 0
    #: which "online" devices were heard live lately (:mod:`cloud_aggregator.serve.liveness`)
    liveness: Liveness = field(default_factory=Liveness)

    @property
    def rejected(self) -> dict[str, int]:
        """Refusals per device, all reasons together."""
        return {d: sum(per.values()) for d, per in list(self.rejected_by_reason.items())}

    def online_devices(self) -> list[str]:
        # list() copies in one step: another task's thread may add a device meanwhile.
        return sorted(d for d, up in list(self.online.items()) if up)

    def live_devices(self) -> list[str]:
        """The online devices heard live lately: those a round waits for (all online, liveness off)."""
        return self.liveness.live(self.online_devices())

    def outside(self, device: str, selection: DeviceSelection | None) -> str | None:
        """Why ``selection`` leaves ``device`` out, judged from the kind and tags in its status."""
        if selection is None:
            return None
        status = self.status.get(device, {})
        kind, tags = status.get("kind"), status.get("tags")
        tags = [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []
        return selection.refusal(device, kind if isinstance(kind, str) else None, tags)

    def refusal(self, device: str, task: str, selection: DeviceSelection | None) -> str | None:
        """Why ``device`` will not run ``task``, from its retained status; ``None``: it may.

        Either the task's ``selection`` leaves it out (its declared ``kind`` and ``tags``)
        or the device said so itself (``refused: {task: reason}``).
        """
        why = self.outside(device, selection)
        if why is not None:
            return why
        refused = self.status.get(device, {}).get("refused")
        why = refused.get(task) if isinstance(refused, dict) else None
        return why if isinstance(why, str) else None

    def trained_rounds(self, task: str) -> dict[str, int]:
        """Device -> the last round of ``task`` it trained, from the statuses (``tasks.<task>.round``)."""
        out = {}
        for device, status in list(self.status.items()):
            r = status.get("rounds", {}).get(task)
            if r is not None:
                out[device] = r
        return out

    def ahead(self, task: str, round_: int) -> dict[str, int]:
        """Devices whose status says they trained ``task`` at or past ``round_`` on another global:
        device -> its round (``ahead_of_aggregator``, set by a device that ignores a lower round)."""
        out = {}
        for device, status in list(self.status.items()):
            said = status.get("ahead_of_aggregator")
            said = said.get(task) if isinstance(said, dict) else None
            r = said.get("device_round") if isinstance(said, dict) else None
            if isinstance(r, int) and not isinstance(r, bool) and r >= round_:
                out[device] = r
        return out

    def holdout_score(self, device: str, task: str, request: CollectRequest) -> dict[str, float] | None:
        """``device``'s score of ``request``'s global, from its status; ``None`` until it reports one."""
        scores = self.status.get(device, {}).get("holdout")
        score = HoldoutScore.from_json(scores.get(task)) if isinstance(scores, dict) else None
        if score is None or (score.round, score.phase, score.global_hash) != (
            request.round,
            request.phase,
            request.global_hash,
        ):
            return None
        return score.metrics


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
        self._announced: dict[str, list[tuple[str, bytes]]] = {}  # task -> its retained messages
        #: task -> uplinks waiting for that task's collecting thread (or its first round)
        self._queues: dict[str, queue.Queue[Message]] = {}
        self._pump = threading.Lock()  # held by the thread reading the session
        self._admit = threading.Lock()  # admission and its counts are shared by every task
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
        # Tasks with scaling = "fleet": the devices' feature statistics, pooled once (fleet_scaling).
        self.scaling = ScalingPool(
            self.fleet,
            lambda topic, payload: self.session.publish(topic, payload, retain=True, timeout=None),
            self._scaling_refusal,
            lambda device: reported_train_rows(statuses.get(device)),
            lambda task: self.admission.policy.task_max_samples.get(task, self.admission.policy.max_samples),
        )
        session.subscribe(topics.topic_stats_all(self.fleet))
        session.on_connect_hooks.append(self.scaling.republish)
        # After a broker restart the retained announcement may be gone: publish it again.
        session.on_connect_hooks.append(self._republish)
        # Retained statuses may not reach us (ioft_protocol.restate): ask every device for its own.
        self._links: dict[str, tuple | None] = {}  # device -> the connection its last status came from
        self._roll_called = float("-inf")  # monotonic time of the last roll call
        session.on_connect_hooks.append(self._roll_call)  # and wait_for_devices() calls it at start
        #: task -> how many announcements it has published; (device, task) -> the one last restated
        self._serial: dict[str, int] = {}
        self._restated: dict[tuple[str, str], int] = {}
        #: restatements not sent: that device already had the task's current announcement restated
        self.restates_skipped = 0
        # A device's statuses are state: while one waits in the inbound queue, a newer one replaces
        # its payload instead of queueing behind it, so a device flooding statuses holds one slot.
        self._status_lock = threading.Lock()
        self._pending_status: dict[str, bytes] = {}
        self._pending_live: set[str] = set()  # of those, the topics a live status was merged into
        self.statuses_coalesced = 0
        if hasattr(session, "tap") and hasattr(session, "inbound"):
            session.tap(topics.topic_status_all(self.fleet), self._coalesce_status)

    def _republish(self) -> None:
        for published in list(self._announced.values()):
            for topic, payload in published:
                self.session.publish(topic, payload, retain=True, timeout=None)

    def _scaling_refusal(self, task: str, device: str) -> str | None:
        """Why ``device`` may not add its statistics to ``task``'s fleet scaling (``None``: it may)."""
        if device in self.holdouts.get(task, ()):
            return "the device is held out of the task"
        return self.view.outside(device, self.selections.get(task))

    def _roll_call(self) -> None:
        self._roll_called = time.monotonic()
        self.session.publish(topics.topic_roll_call(self.fleet), b"", timeout=None)

    def _coalesce_status(self, msg: Message) -> bool:
        """Network thread: a status whose topic has one queued already replaces that one's payload
        (``True``: absorbed); otherwise it is queued as usual (``False``)."""
        with self._status_lock:
            if msg.topic in self._pending_status:
                self._pending_status[msg.topic] = msg.payload
                if not msg.retain:  # the merged status was heard live (liveness)
                    self._pending_live.add(msg.topic)
                self.statuses_coalesced += 1
                return True
            # Only this thread fills the queue: not full now means the put right after succeeds.
            if not self.session.inbound.full():
                self._pending_status[msg.topic] = msg.payload
        return False

    def _latest(self, msg: Message) -> Message:
        """``msg``, or the newer status that replaced its payload while it was queued."""
        if not self._pending_status:
            return msg
        with self._status_lock:
            payload = self._pending_status.pop(msg.topic, None)
            live = msg.topic in self._pending_live
            self._pending_live.discard(msg.topic)
        return msg if payload is None else Message(msg.topic, payload, msg.retain and not live)

    def _restate(self, device: str, status: dict) -> None:
        """A device online on a connection not seen before gets each task's current announcement
        on its own downlink: the retained one may not reach it (``ioft_protocol.restate``).

        At most once per connection and per announcement: a device that reconnects (or claims to,
        with a new ``connected_at`` in every status) as fast as it can gets one copy per round."""
        link = restate.connection(status)
        known = self._links.get(device)
        self._links[device] = link
        if link is None or link == known:
            return
        for task, published in list(self._announced.items()):
            serial = self._serial.get(task, 0)
            if self._restated.get((device, task)) == serial:
                self.restates_skipped += 1
                if self.restates_skipped == 1 or self.restates_skipped % 1000 == 0:
                    log.warning(
                        "%s reconnects faster than rounds go by: its task %s announcement was restated "
                        "once already (%d restatements skipped so far)",
                        device,
                        task,
                        self.restates_skipped,
                    )
                continue
            sent = restate.restatement(self.fleet, task, device, published)
            if sent is not None:
                self._restated[(device, task)] = serial
                self.session.publish(*sent, timeout=None)

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
        topic = topics.topic_down(self.fleet, spec.name)
        payload = ann.encode()
        published = [(topic, payload)]
        for device, params in request.downlinks.items():
            personal = replace(
                ann, params=params, params_hash=param_hash(params), for_device=device, downlink=None
            )
            published.append((topics.topic_down_device(self.fleet, spec.name, device), personal.encode()))
        self._announced[spec.name] = published
        self._serial[spec.name] = self._serial.get(spec.name, 0) + 1
        for t, p in published[:-1]:
            self.session.publish(t, p, retain=True, timeout=None)
        # The broker acks in order: the last one's ack says it holds them all.  While it is away there
        # is nothing to wait for: the round's clock runs on, and the outbox sends it on the reconnect.
        link = getattr(self.session, "connected", None)
        wait = ANNOUNCE_ACK_S if link is None or link.is_set() else None
        try:
            self.session.publish(*published[-1], retain=True, timeout=wait)
        except MqttError as exc:
            log.warning(
                "round %d: announcement not acknowledged (%s); it goes out when the broker is back, "
                "and the round goes on",
                request.round,
                exc,
            )

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

    @staticmethod
    def _is_uplink(topic: str) -> bool:
        try:
            return parse_topic(topic).kind in ("up", "secagg_up")  # routed to the task's queue
        except codec.WireError:
            return False

    def _queue(self, task: str) -> queue.Queue[Message]:
        q = self._queues.get(task)
        if q is None:
            limit = getattr(getattr(self.session, "inbound", None), "maxsize", 0) or 10_000
            q = self._queues.setdefault(task, queue.Queue(limit))  # bounded like the session's
        return q

    def _route(self, msg: Message) -> None:
        """Queue an uplink for its task's thread; one for a task this aggregator does not run is dropped."""
        try:
            topic = parse_topic(msg.topic)
        except codec.WireError:
            return
        if self.selections and topic.task not in self.selections:
            return  # another aggregator's task, or none: not ours to judge (as before tasks ran side by side)
        try:
            self._queue(topic.task).put_nowait(msg)
        except queue.Full:
            log.error("task %s: uplink queue full; dropped an upload from %s", topic.task, topic.device)

    def _routes_to(self, topic: str) -> str | None:
        """The task whose queue :meth:`_route` puts an uplink on ``topic`` in (``None``: none)."""
        try:
            task = parse_topic(topic).task
        except codec.WireError:
            return None
        return task if not self.selections or task in self.selections else None

    def next_message(self, task: str, timeout: float) -> Message | None:
        """The next message for ``task``'s round: an uplink of the task, or a status (already kept).

        The thread that gets the pump reads the session for every task; the others wait on their queue.
        An uplink of the pump holder's own task goes straight to it, in arrival order: its queue is
        empty then (looked at once the pump is held: only the pump holder fills the queues).
        """
        mine = self._queue(task)
        deadline = time.monotonic() + timeout
        while True:
            if mine.queue:  # a look without its lock: only this task's thread takes from it
                return mine.get_nowait()
            left = deadline - time.monotonic()
            if not self._pump.acquire(blocking=False):
                try:
                    return mine.get(timeout=max(0.0, min(left, 0.05)))
                except queue.Empty:
                    if left <= 0:
                        return None
                    continue
            try:
                if mine.queue:  # routed by the previous pump holder before we took the pump: those came first
                    return mine.get_nowait()
                msg = self.session.get(max(0.0, left))
            finally:
                self._pump.release()
            if msg is None:
                return None
            if not self._is_uplink(msg.topic):
                return msg  # a status (or stray topic): the caller's handle() keeps it
            if self._routes_to(msg.topic) == task:
                return msg
            self._route(msg)

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection | LateUpdate | SatOut]:
        # Keyed by device; a straggler's late upload by ("late", device) beside its fresh one.
        received = _Inbox()
        if self.store is not None and request.fold is not None:
            self._restore_fold(request, received)
        if self.store is not None:  # updates that arrived before a restart: no device needs to resend
            name = request.spec.name
            stored = self.store.stored_updates(name, request.round, request.phase, request.global_hash)
            late = request.late
            if late is not None:
                stored += self.store.stored_updates(name, late.round, late.phase, late.global_hash)
            for chunk in _chunks([(device, payload, None, False) for device, payload in stored]):
                self._ingest(request, received, chunk, persist=False)
            if stored:
                log.info(
                    "round %d/%s: %d uploads restored from the store",
                    request.round,
                    request.phase,
                    len(stored),
                )
        fixed = bool(self.policy.expected) or request.participants is not None
        expected = set(self.policy.expected) or set(self.view.live_devices())
        if request.participants is not None:  # the server chose: wait for those only
            expected = set(request.participants)
        task, selection = request.spec.name, self.selections.get(request.spec.name)
        held_out = set(self.holdouts.get(task, ()))
        refused: dict[str, str] = {}
        scores: dict[str, dict[str, float]] = {}

        def scoring() -> set[str]:
            """Held-out devices online that have not yet scored this round's global (noted when they have)."""
            waiting = set()
            for d in held_out:  # a few devices: never a scan of the whole (possibly 10k) fleet
                if not self.view.online.get(d) or not self.view.liveness.is_live(d):
                    continue  # a held-out device that is away (or only retained "online") is not awaited
                score = self.view.holdout_score(d, task, request)
                if score is not None:
                    scores[d] = score
                elif self.view.refusal(d, task, selection) is None:
                    waiting.add(d)
            return waiting

        def awaited(devices: set[str]) -> set[str]:
            """``devices`` less those outside the selection or that refused the task (noted)."""
            out = set()
            for d in devices:
                why = self.view.refusal(d, task, selection)
                if why is None or isinstance(received.get(d), Update):
                    out.add(d)
                else:
                    refused[d] = why
            return out

        expected = awaited(expected) - held_out
        last_online = set(self.view.live_devices())
        if not fixed:
            self._say_skipped(request)
        closed = "deadline"
        deadline = time.time() + self.policy.deadline_s
        self.announce(request, deadline)
        faults.point("after_announce")
        extensions = 0
        seen = self.view.changes
        looked_short = False
        while True:
            answered = received.answered
            valid = len(answered)
            # All awaited devices answered (and held-out ones scored); too few of them for
            # min_participants waits for more.
            if expected and expected <= answered and valid >= self.policy.min_participants and not scoring():
                closed = "answered"
                break
            # Short because devices refuse the task: said once everyone who takes it answered (the
            # round would only wait out its deadline), or at the deadline (some never came).
            short = refused and valid < self.policy.min_participants and not looked_short
            if short and ((expected and expected <= answered) or time.time() >= deadline):
                self._say_if_short(task, expected | answered, refused)
                looked_short = True  # once a round: a change shows in the next round's look
            if time.time() >= deadline:
                self._say_whom(request, expected - answered)
                if valid >= self.policy.min_participants or extensions >= self.policy.max_extensions:
                    break
                extensions += 1
                deadline = time.time() + self.policy.deadline_s
                with self._admit:
                    stale = self.admission.forget_stale(request, valid)
                if stale:
                    log.warning(
                        "round %d: the norm reference refused most uploads; it is stale, dropping it "
                        "so the resent uploads are judged afresh",
                        request.round,
                    )
                log.warning(
                    "task %s round %d: %d valid uploads < min_participants %d; extending the deadline (%d/%d)",
                    task,
                    request.round,
                    valid,
                    self.policy.min_participants,
                    extensions,
                    self.policy.max_extensions,
                )
                self.announce(request, deadline)
            msg = self.next_message(task, min(0.2, max(0.0, deadline - time.time())))
            # Messages are handled for up to RECHECK_S before the O(N) looks below (once per message
            # they cost O(N²) per round at thousands of devices), or until the last awaited may be in.
            # Uploads are ingested in batches: whatever waited in the queue (``_ingest``).
            until = time.monotonic() + RECHECK_S
            received.batch = []
            try:
                while msg is not None:
                    self.handle(msg, request, received)
                    left = min(until - time.monotonic(), deadline - time.time())
                    if len(received) + len(received.batch) >= len(expected) or left <= 0:
                        break
                    msg = self.next_message(task, 0.0)
                    if msg is None:  # nothing waits: what came is stored and counted before waiting on
                        self._flush(request, received)
                        if len(received) >= len(expected):
                            break
                        msg = self.next_message(task, left)
            finally:
                self._flush(request, received)
                received.batch = None
            # Statuses may have come through another task's thread: look at the view whenever one
            # came (an O(N) look: not on turns that brought only uploads).
            # Without a fixed list, a device that comes online mid-round (heard live) is awaited (it
            # gets the retained announcement), one that goes offline is not; whoever answered counts.
            # One awaited stays awaited while it says online, even with its heartbeat late (a long
            # local training): liveness decides whom a round starts with, and who joins it.
            if self.view.changes == seen:
                continue
            seen = self.view.changes
            claims = self.view.online_devices()
            online, live = set(claims), set(self.view.liveness.live(claims))
            if not fixed:
                expected = (expected & online) | (live - last_online) | received.answered
            # A device that refused and takes the task again (its owner resumed it) is awaited again.
            back = {d for d in refused if d in live and self.view.refusal(d, task, selection) is None}
            for d in back:
                del refused[d]
            expected |= back - held_out
            last_online = live
            # A device that refuses the task (its status says so, at once) is not waited for.
            expected = awaited(expected) - held_out
        online = set(self.view.online_devices())
        awaited(online)  # note every online device that sat this round out, and why
        out: list[Update | Rejection | LateUpdate | SatOut] = list(received.values())
        if refused:
            log.info("round %d/%s: not run by %s", request.round, request.phase, refused)
        scoring()  # the scores that came with the last messages
        skipped = {} if fixed else self._unconfirmed(set(received.answered))
        # How it closed, in every record; who sat it out, who was skipped as not live (liveness),
        # and what held-out devices scored.
        out.append(SatOut(closed, dict(sorted(refused.items())), dict(sorted(scores.items())), skipped))
        return out

    def _unconfirmed(self, answered: set[str]) -> dict[str, str]:
        """Online devices not heard live lately (not waited for), less those that answered anyway."""
        found = self.view.liveness.unconfirmed(self.view.online_devices())
        return {d: why for d, why in sorted(found.items()) if d not in answered}

    def _say_skipped(self, request: CollectRequest) -> None:
        """One line naming the devices a round does not wait for as not live (again only on a change),
        and a roll call for them."""
        skipped = self._unconfirmed(set())
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

    def _say_whom(self, request: CollectRequest, missing: set[str]) -> None:
        """At a deadline: which awaited devices did not answer, and which trained past this round
        already (the store is behind them: ``serve --resume-from-devices``)."""
        where = f"task {request.spec.name} round {request.round}/{request.phase}"
        if missing:
            named = sorted(missing)
            more = f" and {len(named) - NAMED} more" if len(named) > NAMED else ""
            log.warning("%s: deadline passed waiting for %s%s", where, ", ".join(named[:NAMED]), more)
        ahead = self.view.ahead(request.spec.name, request.round)
        if ahead:
            named = sorted(ahead, key=lambda d: (-ahead[d], d))
            more = f" and {len(named) - NAMED} more" if len(named) > NAMED else ""
            log.warning(
                "%s: %d device(s) trained past it already, they ignore it: %s%s. This store is behind "
                "its devices (an older aggregator.sqlite, or a fresh one): restart with "
                "`cloud-aggregator serve --resume-from-devices` to go on from round %d",
                where,
                len(ahead),
                ", ".join(
                    f"{d} (round {ahead[d]}, {ahead[d] - request.round + 1} ahead)" for d in named[:NAMED]
                ),
                more,
                max(ahead.values()) + 1,
            )

    def _say_if_short(self, task: str, takers: set[str], refused: dict[str, str]) -> None:
        """Say in one line when devices refusing ``task`` leave its rounds short of ``min_participants``
        (``takers``: the online devices that take it): otherwise each round would wait out its deadline
        and extensions and be abandoned, with nothing naming the cause.  Said once per task, again only
        when who takes it or who refuses it changes."""
        need = self.policy.min_participants
        if len(takers) >= need:
            return
        key = (tuple(sorted(takers)), tuple(sorted(refused.items())))
        if self._short.get(task) == key:
            return
        self._short[task] = key
        whys = "; ".join(f"{d} refuses it: {why}" for d, why in sorted(refused.items()))
        log.warning(
            "task %s: its rounds cannot reach [collect] min_participants = %d with the devices online: "
            "%d take it (%s); %s. Each round waits deadline_s, is extended %d times, then abandoned: "
            "lower min_participants, or bring devices that can run the task",
            task,
            need,
            len(takers),
            ", ".join(sorted(takers)) or "none",
            whys,
            self.policy.max_extensions,
        )

    def handle(self, msg: Message, request: CollectRequest | None, received: dict | None = None) -> None:
        msg = self._latest(msg)
        try:
            topic = parse_topic(msg.topic)
        except codec.WireError as exc:
            log.warning("ignored message on unexpected topic %r: %s", msg.topic, exc)
            return
        if topic.fleet != self.fleet:
            return
        if topic.kind == "status":
            if isinstance(received, _Inbox):  # uploads read before it are judged on the status they saw
                self._flush(request, received)
            self._status(topic.device, msg.payload, live=not msg.retain)
        elif topic.kind == "stats":
            self.scaling.handle(str(topic.task), str(topic.device), msg.payload)
        elif topic.kind == "up" and request is not None and received is not None:
            if topic.task != request.spec.name:
                return
            outside = self.view.outside(topic.device, self.selections.get(topic.task))
            held_out = topic.device in self.holdouts.get(topic.task, ())
            upload = (topic.device, msg.payload, outside, held_out)
            batch = getattr(received, "batch", None)
            if batch is None:
                self._ingest(request, received, [upload])
                return
            batch.append(upload)
            if len(batch) >= min(INGEST_MAX, max(1, INGEST_BYTES // max(1, len(msg.payload)))):
                self._flush(request, received)
        elif topic.kind == "up":
            self._ingest(None, {}, [(topic.device, msg.payload, None, False)])

    def _status(self, device: str, payload: bytes, live: bool = True) -> None:
        try:
            status = json.loads(payload)
            if not isinstance(status, dict):
                raise ValueError("status must be a JSON object")
        except ValueError as exc:
            log.warning("bad status from %s: %s", device, exc)
            return
        self._restate(device, status)
        kept = {k: status[k] for k in KEPT_STATUS if k in status}
        tasks = status.get("tasks")
        if isinstance(tasks, dict):  # the round of each task it trained last (serve --resume-from-devices)
            kept["rounds"] = {
                t: v["round"]
                for t, v in tasks.items()
                if isinstance(v, dict)
                and isinstance(v.get("round"), int)
                and not isinstance(v["round"], bool)
            }
        self.view.status[device] = kept
        online = status.get("state") == "online"
        self.view.online[device] = online
        self.view.liveness.note(device, online, live)
        self.view.changes += 1

    def _refusal_row(
        self,
        device: str,
        request: CollectRequest | None,
        verdict: Refusal,
        answering: tuple[str, int | None] | None = None,
    ) -> StoredRefusal:
        """Log a refused upload (admission counted it); the row that stores it, filed under
        ``answering`` (task, round) where given (a worker's batch says which), else ``request``'s round."""
        level = logging.INFO if verdict.reason in ROUTINE_REFUSALS else logging.WARNING
        log.log(level, "dropped update from %s: %s", device, verdict)
        if answering is None:
            answering = (request.spec.name, request.round) if request is not None else ("", None)
        return (*answering, device, verdict.reason, verdict.detail)

    def _record_refusal(
        self,
        device: str,
        request: CollectRequest | None,
        verdict: Refusal,
        *,
        answering: tuple[str, int | None] | None = None,
    ) -> None:
        """Log and store a refused upload (admission counted it)."""
        row = self._refusal_row(device, request, verdict, answering)
        if self.store is not None:
            self.store.put_rejection(*row)

    def _accept(
        self,
        device: str,
        payload: bytes,
        request: CollectRequest | None,
        received: Inbox,
        *,
        persist: bool,
        outside: str | None = None,
        held_out: bool = False,
    ) -> None:
        """:meth:`_ingest` of one upload."""
        self._ingest(request, received, [(device, payload, outside, held_out)], persist=persist)

    def _flush(self, request: CollectRequest | None, received: Any) -> None:
        """Ingest the uploads ``received`` holds back (:attr:`_Inbox.batch`), if any."""
        batch = getattr(received, "batch", None)
        if batch:
            received.batch = []
            self._ingest(request, received, batch)

    def _ingest(
        self,
        request: CollectRequest | None,
        received: Inbox,
        uploads: list[tuple[str, bytes, str | None, bool]],
        *,
        persist: bool = True,
    ) -> None:
        """Admit a batch of uplinks ``(device, payload, outside, held_out)`` into ``received``; never raises.

        Admission judges each in arrival order (one decode, one tensor check); the admitted ones
        and the refusals are stored in one transaction; only then is each admitted upload folded
        (a streaming round: one NumPy pass over the batch) and filed: an upload counts once it is
        durable, so a kill at any instant leaves it stored or uncounted (its device re-sends it).
        ``persist`` ``False``: they were read back from the store.  ``outside`` (why the device is
        outside the task's selection) and ``held_out`` go to admission.
        """
        with self._admit:
            verdicts = [
                self.admission.verdict(d, p, request, restored=not persist, outside=o, held_out=h)
                for d, p, o, h in uploads
            ]
        keep: list[StoredUpload] = []
        refusals: list[StoredRefusal] = []
        for (device, payload, _, _), verdict in zip(uploads, verdicts, strict=True):
            if isinstance(verdict, Refusal):
                refusals.append(self._refusal_row(device, request, verdict))
                continue
            if isinstance(verdict, LateUpdate):
                log.info(
                    "late update from %s for round %d counts in round %d",
                    device,
                    verdict.round,
                    request.round,
                )
            if persist:  # durable like any upload: a restart keeps it
                late = request.late
                r, phase, gh = (
                    (late.round, late.phase, late.global_hash)
                    if isinstance(verdict, LateUpdate)
                    else (request.round, request.phase, request.global_hash)
                )
                keep.append((request.spec.name, r, phase, device, gh, payload))
        if self.store is not None:
            self.store.put_batch(keep, refusals)
        if request is not None and request.fold is not None:
            verdicts = self._fold(request, verdicts)
        for (device, *_), verdict in zip(uploads, verdicts, strict=True):
            entry = filing(device, verdict, received.get(device))
            if entry is not None:
                received[entry[0]] = entry[1]

    def _fold(
        self, request: CollectRequest, verdicts: list[Update | LateUpdate | Refusal]
    ) -> list[Update | LateUpdate | Refusal]:
        """Fold the admitted uploads among ``verdicts`` into the round's running sum, checkpointing
        every ``checkpoint_every``; the verdicts to file (admitted ones without their params)."""
        fold, every = request.fold, self.policy.checkpoint_every
        out = list(verdicts)
        fresh = [i for i, v in enumerate(verdicts) if isinstance(v, Update)]
        while fresh:
            room = max(1, every - len(fold.pending)) if self.store is not None else len(fresh)
            chunk, fresh = fresh[:room], fresh[room:]
            fold.add_many([verdicts[i] for i in chunk])
            for i in chunk:
                out[i] = replace(verdicts[i], params={})
            if self.store is not None and len(fold.pending) >= every:
                self._checkpoint(request)
        return out

    def _checkpoint(self, request: CollectRequest) -> None:
        """Store the round's partial sum; the uploads it covers leave the store."""
        fold = request.fold
        folded = dict(fold.pending)
        self.store.put_partial(
            request.spec.name, request.round, request.phase, request.global_hash, fold.checkpoint(), folded
        )

    def _restore_fold(self, request: CollectRequest, received: Inbox) -> None:
        """Continue a streaming round from its last checkpoint (a restart): the devices folded in
        it count with their stored sample counts and metrics, and their re-sends are replays."""
        kept = self.store.partial(request.spec.name, request.round, request.phase, request.global_hash)
        if kept is None:
            return
        state, folded = kept
        request.fold.restore(state, folded)
        with self._admit:
            self.admission.restore_folded(request, sorted(folded))
        for device, (n_samples, metrics) in folded.items():
            received[device] = Update(device, {}, n_samples, metrics)
        log.info(
            "round %d/%s: partial sum of %d uploads restored from the store",
            request.round,
            request.phase,
            len(folded),
        )


def _chunks(
    uploads: list[tuple[str, bytes, str | None, bool]],
) -> list[list[tuple[str, bytes, str | None, bool]]]:
    """``uploads`` in batches of at most ``INGEST_MAX`` uploads and about ``INGEST_BYTES`` bytes."""
    out: list[list[tuple[str, bytes, str | None, bool]]] = []
    size = INGEST_BYTES
    for upload in uploads:
        if not out or size + len(upload[1]) > INGEST_BYTES or len(out[-1]) >= INGEST_MAX:
            out.append([])
            size = 0
        out[-1].append(upload)
        size += len(upload[1])
    return out

"""The fleet over MQTT: announce a round (retained), collect uploads until every
expected device answered or the deadline passed.

Every uplink is decoded only after its size is checked; its topic's device must be
the device named inside; it must be for this fleet, task, round, phase and the
global parameters the round started from.  Anything else is logged with the device
id, counted and dropped: a malformed payload never stops a round.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from cloud_aggregator import faults
from cloud_aggregator.admission import Admission, AdmissionPolicy, Refusal, check_tensors
from cloud_aggregator.rounds import CollectRequest, LateUpdate, Rejection
from cloud_aggregator.store import SqliteStore
from cloud_aggregator.strategies import Update
from ioft_protocol import codec, round_messages, topics
from ioft_protocol.mqtt import Message, MqttSession
from trainer_lite.params import param_hash

log = logging.getLogger(__name__)


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


@dataclass
class FleetView:
    """What the aggregator knows of each device (from retained status messages)."""

    online: dict[str, bool] = field(default_factory=dict)
    status: dict[str, dict] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    #: device -> reason code (``cloud_aggregator.admission.REASONS``) -> count
    rejected_by_reason: dict[str, dict[str, int]] = field(default_factory=dict)

    def online_devices(self) -> list[str]:
        return sorted(d for d, up in self.online.items() if up)


class MqttFleet:
    """A ``Fleet`` whose devices are ``edge-trainer`` processes reached through a broker."""

    def __init__(
        self,
        session: MqttSession,
        fleet: str,
        policy: CollectPolicy,
        store: SqliteStore | None = None,
        admission: AdmissionPolicy | None = None,
    ):
        self.session = session
        self.fleet = codec.check_id("fleet", fleet)
        self.policy = policy
        self.store = store
        self.view = FleetView()
        self.admission = Admission(admission)
        self._announced: list[tuple[str, bytes]] = []
        self._held: list[Message] = []  # uplinks that arrived before the first round opened
        session.subscribe(topics.topic_status_all(self.fleet))
        session.subscribe(topics.topic_up_all(self.fleet))
        # After a broker restart the retained announcement may be gone: publish it again.
        session.on_connect_hooks.append(self._republish)

    def _republish(self) -> None:
        for topic, payload in list(self._announced):
            self.session.publish(topic, payload, retain=True, timeout=None)

    # -- announcing ---------------------------------------------------------------
    def announce(self, request: CollectRequest, deadline: float, state: str = "running") -> None:
        spec = request.spec
        ann = round_messages.Announcement(
            fleet=self.fleet,
            task=spec.name,
            round=request.round,
            phase=request.phase,
            spec=spec.to_json(),
            deadline=deadline,
            global_hash=request.global_hash,
            state=state,
            params=request.global_params,
            personalized=tuple(request.downlinks),
            participants=request.participants,
        )
        topic = topics.topic_down(self.fleet, spec.name)
        payload = ann.encode()
        published = [(topic, payload)]
        for device, params in request.downlinks.items():
            personal = replace(ann, params=params, params_hash=param_hash(params), for_device=device)
            published.append((topics.topic_down_device(self.fleet, spec.name, device), personal.encode()))
        self._announced = published
        for t, p in published:
            self.session.publish(t, p, retain=True)

    def finish(self, request: CollectRequest) -> None:
        """Announce that the task is done (retained), with the final global parameters."""
        self.announce(request, deadline=time.time(), state="done")

    # -- collecting -------------------------------------------------------------------
    def wait_for_devices(self) -> list[str]:
        """Block until enough devices are online (or the start-up wait passes)."""
        want = set(self.policy.expected) or None
        need = len(want) if want else self.policy.min_participants
        deadline = time.monotonic() + self.policy.startup_wait_s
        while time.monotonic() < deadline:
            online = set(self.view.online_devices())
            if (want and want <= online) or (not want and len(online) >= need):
                break
            msg = self.session.get(0.1)
            if msg is None:
                continue
            if self._is_uplink(msg.topic):
                # Uplinks the broker queued for our persistent session while we were down: the
                # first round collected is the one they answer, so they wait for it (not rejected).
                self._held.append(msg)
            else:
                self._handle(msg, None)
        return self.view.online_devices()

    @staticmethod
    def _is_uplink(topic: str) -> bool:
        try:
            return topics.parse_topic(topic).kind == "up"
        except codec.WireError:
            return False

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection | LateUpdate]:
        # Keyed by device; a straggler's late upload by ("late", device) beside its fresh one.
        received: dict = {}
        if self.store is not None:  # updates that arrived before a restart: no device needs to resend
            name = request.spec.name
            stored = self.store.stored_updates(name, request.round, request.phase, request.global_hash)
            for device, payload in stored:
                self._accept(device, payload, request, received, persist=False)
            late = request.late
            if late is not None:
                for device, payload in self.store.stored_updates(
                    name, late.round, late.phase, late.global_hash
                ):
                    msg = round_messages.UpdateMessage.decode(
                        payload, max_bytes=self.policy.max_payload_bytes
                    )
                    self._take_late(device, msg, payload, request, received, persist=False)
            if stored:
                log.info(
                    "round %d/%s: %d uploads restored from the store",
                    request.round,
                    request.phase,
                    len(stored),
                )
        held, self._held = self._held, []
        for msg in held:
            self._handle(msg, request, received)
        fixed = bool(self.policy.expected) or request.participants is not None
        expected = set(self.policy.expected) or set(self.view.online_devices())
        if request.participants is not None:  # the server chose: wait for those only
            expected = set(request.participants)
        deadline = time.time() + self.policy.deadline_s
        self.announce(request, deadline)
        faults.point("after_announce")
        extensions = 0
        while True:
            answered = {d for d, r in received.items() if isinstance(r, Update)}
            valid = len(answered)
            # All awaited devices answered; too few of them for min_participants waits for more.
            if expected and expected <= answered and valid >= self.policy.min_participants:
                break
            if time.time() >= deadline:
                if valid >= self.policy.min_participants or extensions >= self.policy.max_extensions:
                    break
                extensions += 1
                deadline = time.time() + self.policy.deadline_s
                if self.admission.forget_stale(request, valid):
                    log.warning(
                        "round %d: the norm reference refused most uploads; it is stale, dropping it "
                        "so the resent uploads are judged afresh",
                        request.round,
                    )
                log.warning(
                    "round %d: %d valid uploads < %d; extending the deadline (%d/%d)",
                    request.round,
                    valid,
                    self.policy.min_participants,
                    extensions,
                    self.policy.max_extensions,
                )
                self.announce(request, deadline)
            msg = self.session.get(min(0.2, max(0.0, deadline - time.time())))
            if msg is not None:
                was_online = set(self.view.online_devices())
                self._handle(msg, request, received)
                # Without a fixed list, a device that comes online mid-round is awaited (it gets the
                # retained announcement), one that goes offline is not; whoever answered counts.
                if not fixed:
                    online = set(self.view.online_devices())
                    expected = (
                        (expected & online)
                        | (online - was_online)
                        | {d for d in received if isinstance(received[d], Update)}
                    )
        return list(received.values())

    def _take_late(
        self,
        device: str,
        msg: round_messages.UpdateMessage,
        payload: bytes,
        request: CollectRequest,
        received: dict,
        *,
        persist: bool,
    ) -> bool:
        """Keep a straggler's upload for the previous round (``straggler = "next_round"``).

        Returns ``False`` when ``msg`` is not one (the caller drops it as stale).
        """
        late = request.late
        quoted = (msg.round, msg.phase, msg.global_hash)
        if late is None or quoted != (late.round, late.phase, late.global_hash):
            return False
        if device in late.counted or ("late", device) in received:
            return True  # counted in its own round already, or a duplicate delivery
        try:
            codec.validate_tensors(msg.params, request.expected)
        except codec.WireError as exc:
            self._reject(device, request, f"late update: {exc}")
            return True
        if persist and self.store is not None:  # durable like any upload: a restart keeps it
            self.store.put_update(
                request.spec.name, late.round, late.phase, device, late.global_hash, payload
            )
        log.info("late update from %s for round %d counts in round %d", device, late.round, request.round)
        received[("late", device)] = LateUpdate(
            Update(device, msg.params, msg.n_samples, msg.metrics), late.round
        )
        return True

    def _handle(self, msg: Message, request: CollectRequest | None, received: dict | None = None) -> None:
        try:
            topic = topics.parse_topic(msg.topic)
        except codec.WireError as exc:
            log.warning("ignored message on unexpected topic %r: %s", msg.topic, exc)
            return
        if topic.fleet != self.fleet:
            return
        if topic.kind == "status":
            self._status(topic.device, msg.payload)
        elif topic.kind == "up" and request is not None and received is not None:
            if topic.task != request.spec.name:
                return
            self._accept(topic.device, msg.payload, request, received, persist=True)
        elif topic.kind == "up":
            self._reject(topic.device, None, "update arrived while no round is open")

    def _status(self, device: str, payload: bytes) -> None:
        try:
            status = json.loads(payload)
            if not isinstance(status, dict):
                raise ValueError("status must be a JSON object")
        except ValueError as exc:
            log.warning("bad status from %s: %s", device, exc)
            return
        self.view.status[device] = status
        self.view.online[device] = status.get("state") == "online"

    def _reject(self, device: str, request: CollectRequest | None, reason: str | Refusal) -> None:
        if not isinstance(reason, Refusal):  # callers outside admission: classify by wording
            code = (
                "no_round" if request is None else "non_finite" if "NaN or Inf" in reason else "shape_dtype"
            )
            reason = Refusal(code, reason)
        self.view.rejected[device] = self.view.rejected.get(device, 0) + 1
        per = self.view.rejected_by_reason.setdefault(device, {})
        per[reason.code] = per.get(reason.code, 0) + 1
        log.warning("dropped update from %s: %s", device, reason)
        if self.store is not None:
            self.store.put_rejection(
                request.spec.name if request else "", request.round if request else None, device, str(reason)
            )

    def _refuse(self, device: str, request: CollectRequest, received: dict, refusal: Refusal) -> None:
        """Count a refusal and mark the device's round answer rejected unless it already uploaded."""
        self._reject(device, request, refusal)
        if not isinstance(received.get(device), Update):
            received[device] = Rejection(device, str(refusal))

    def _accept(
        self, device: str, payload: bytes, request: CollectRequest, received: dict, *, persist: bool
    ) -> None:
        """Admit an uplink or count why not (``cloud_aggregator.admission``); never raises."""
        try:
            msg = round_messages.UpdateMessage.decode(payload, max_bytes=self.policy.max_payload_bytes)
        except codec.WireError as exc:
            self._refuse(device, request, received, Refusal("malformed", str(exc)))
            return
        spec = request.spec
        if msg.device != device:
            self._reject(
                device, request, Refusal("impersonation", f"payload claims to be from {msg.device!r}")
            )
            return
        if (msg.fleet, msg.task) != (self.fleet, spec.name):
            detail = f"update for {msg.fleet}/{msg.task}, not {self.fleet}/{spec.name}"
            self._reject(device, request, Refusal("wrong_task", detail))
            return
        off_round = self.admission.check_round(msg.round, msg.phase, msg.global_hash, request)
        if off_round is not None:
            if self._take_late(device, msg, payload, request, received, persist=persist):
                return  # a straggler counted in this round (straggler = "next_round")
            # Stale retries are normal after a restart; counted (not aggregated) all the same.
            self._reject(device, request, off_round)
            return
        if isinstance(received.get(device), Update):
            # QoS 1 redelivery or a resend: the first upload stands.
            self._reject(device, request, Refusal("duplicate", "device already uploaded for this round"))
            return
        if request.participants is not None and device not in request.participants:
            self._refuse(
                device, request, received, Refusal("not_selected", "device was not selected for this round")
            )
            return
        bad = check_tensors(msg.params, request.expected_by_device.get(device, request.expected))
        # Restored uploads were admitted before the restart: replay/norm history is not re-judged.
        if bad is None and persist:
            bad = self.admission.check_new(device, msg.params, request)
        if bad is not None:
            self._refuse(device, request, received, bad)
            return
        if persist and self.store is not None:
            self.store.put_update(
                spec.name, request.round, request.phase, device, request.global_hash, payload
            )
        self.admission.admitted(device, msg.params, request)
        received[device] = Update(device, msg.params, msg.n_samples, msg.metrics)

"""What the aggregator knows of each device, from the statuses it reads (retained or live).

A round reads it through ``cloud_aggregator.rounds.collector.Roster``: who is online and live,
who refuses a task or is outside its selection, what held-out devices scored.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from cloud_aggregator.rounds.types import CollectRequest, Reason
from cloud_aggregator.serve.liveness import Liveness
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.round_messages import DeviceSelection, HoldoutScore

#: What the aggregator reads of a device's retained status (the rest is the console's, which
#: reads the broker itself): 10,000 whole statuses would be tens of MB of parsed JSON.
KEPT_STATUS = ("state", "kind", "tags", "refused", "holdout", "data", "ahead_of_aggregator")


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

    def take(self, device: str, status: dict, live: bool) -> None:
        """Keep what a round reads of ``device``'s ``status`` (``live``: sent while we listened)."""
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
        self.status[device] = kept
        online = status.get("state") == "online"
        self.online[device] = online
        self.liveness.note(device, online, live)
        self.changes += 1


class LatestStatus:
    """A device's statuses are state: while one waits in the session's inbound queue, a newer one
    replaces its payload instead of queueing behind it, so a device flooding statuses holds one slot."""

    def __init__(self, session: MqttSession) -> None:
        self.session = session
        self._lock = threading.Lock()
        self._pending: dict[str, bytes] = {}  # status topic -> the newest payload, while one is queued
        self._live: set[str] = set()  # of those, the topics a live status was merged into
        self.coalesced = 0

    def absorb(self, msg: Message) -> bool:
        """Network thread: a status whose topic has one queued already replaces that one's payload
        (``True``: absorbed); otherwise it is queued as usual (``False``)."""
        with self._lock:
            if msg.topic in self._pending:
                self._pending[msg.topic] = msg.payload
                if not msg.retain:  # the merged status was heard live (liveness)
                    self._live.add(msg.topic)
                self.coalesced += 1
                return True
            # Only this thread fills the queue: not full now means the put right after succeeds.
            if not self.session.inbound.full():
                self._pending[msg.topic] = msg.payload
        return False

    def latest(self, msg: Message) -> Message:
        """The status ``msg``, or the newer one that replaced its payload while it was queued."""
        if not self._pending:
            return msg
        with self._lock:
            payload = self._pending.pop(msg.topic, None)
            live = msg.topic in self._live
            self._live.discard(msg.topic)
        return msg if payload is None else Message(msg.topic, payload, msg.retain and not live)

"""The daemon's life around its rounds: start, the loop, the downlinks, the owner's pause, shutdown.

The life is three calls, which :meth:`ServiceLoop.run` and ``edge.swarm`` (thousands of virtual
devices in one process, one network loop) share: :meth:`~ServiceLoop.start`, then
:meth:`~ServiceLoop.handle` for each downlink and :meth:`~ServiceLoop.tick` once a second, and
:meth:`~ServiceLoop.shutdown`.  A round announcement goes to the daemon's ``on_announcement``
(:class:`edge.daemon.EdgeTrainer`, which holds this loop).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Protocol

from edge.announcements import Announcements
from edge.buffered import Pacer
from edge.config import DeviceConfig
from edge.device_link import DeviceLink
from edge.fleet_scaling import FleetStats
from edge.models.manager import ModelManager
from edge.optout import REASON as PAUSED
from edge.optout import PauseWatch
from edge.secagg_client import SecAggDevice
from edge.serving.server import Server
from edge.task_state import TaskState
from ioft_protocol import codec, round_messages, topics
from ioft_protocol.mqtt_options import MqttError
from ioft_protocol.secagg import transport as secagg_wire
from ioft_protocol.service import Notifier
from trainer_lite.data import Dataset

log = logging.getLogger(__name__)

Announcement = round_messages.Announcement
#: Topics whose parse a device keeps (:meth:`ServiceLoop._parse`); past it the memory starts afresh.
_TOPICS_KEPT = 64
#: SecAgg's stage topics (``ioft_protocol.secagg.transport``): a device acts on its own downlink only.
_SECAGG = ("secagg_up", "secagg_down")


class Daemon(Protocol):
    """What the loop reads of the daemon it serves (:class:`edge.daemon.EdgeTrainer`)."""

    config: DeviceConfig
    device: str
    state_dir: Path
    notifier: Notifier
    link: DeviceLink
    serving: Server
    secagg: SecAggDevice
    models: ModelManager | None
    fleet_stats: FleetStats
    announcements: Announcements
    pause: PauseWatch
    pacer: Pacer
    tasks: dict[str, TaskState]
    refused: dict[str, str]
    rounds_done: int
    train: Dataset
    test: Dataset

    def on_announcement(self, ann: Announcement) -> None: ...

    def pace(self) -> None: ...


class ServiceLoop:
    """The life of daemon ``d`` (see the module docstring); ``last_ann``: per task, the latest
    announcement (answered again on resume, or when its pooled transform comes)."""

    def __init__(self, d: Daemon, last_ann: dict[str, Announcement]) -> None:
        self.d, self.last_ann = d, last_ann
        self.stopping = threading.Event()
        self._topics: dict[str, topics.Topic] = {}  # parsed topics (:meth:`_parse`)

    def run(self) -> None:
        """Start, then handle downlinks, pace and tick until :attr:`stopping` is set; shut down."""
        d = self.d
        session = d.link.session
        self.start()
        next_tick = time.monotonic()
        try:
            while not self.stopping.is_set():
                if session.fatal:
                    raise MqttError(session.fatal)
                d.notifier.alive()  # from this loop, so systemd's watchdog restarts a hung one
                if not d.notifier.ready_sent and session.connected.is_set():
                    d.notifier.ready(f"connected to {d.config.broker}")
                msg = session.get(min(0.2, max(0.0, d.pacer.next_at - time.monotonic())))
                if msg is not None:
                    self.handle(msg.topic, msg.payload)
                d.pace()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + 1.0
                    self.tick()
        finally:
            self.shutdown()

    def start(self) -> None:
        """Subscribe to the fleet's downlinks and connect (in the background, retrying forever)."""
        d = self.d
        d.link.subscribe(models=d.models is not None)
        d.link.session.start(timeout=None)  # paho keeps retrying until the broker is there
        d.serving.start()
        log.info(
            "%s running (state %s, %d train / %d test rows)", d.device, d.state_dir, len(d.train), len(d.test)
        )

    def tick(self) -> None:
        """Once a second: the owner's pause file, the aggregator's silence, model pushes waiting for a
        retry, and the status when it is due (:meth:`edge.device_link.DeviceLink.tick`)."""
        d = self.d
        if d.pause.changed():
            self.pause_changed()
        d.link.check_heard()
        d.link.clock.due |= d.serving.take_changed()  # answers and refusals show in the status
        d.link.tick(d.models is not None and d.models.tick())

    def shutdown(self) -> None:
        """Publish the retained offline status and disconnect cleanly."""
        d = self.d
        d.notifier.stopping(f"stopping after {d.rounds_done} rounds")
        if d.models is not None:
            d.models.close()
        d.serving.close()
        d.link.session.stop(final=d.link.status("offline"))
        log.info("%s stopped after %d rounds", d.device, d.rounds_done)

    def pause_changed(self) -> None:
        """The owner paused (every task known here is refused, so no round waits for this device)
        or resumed (the refusals go, and the tasks' current rounds are answered)."""
        d = self.d
        reason = d.pause.reason
        if reason is not None:
            log.warning("%s: %s; taking part in no task until `edge-trainer resume`", d.device, reason)
            d.refused.update(dict.fromkeys({*d.tasks, *d.refused, *self.last_ann}, reason))
            d.link.publish_status()
            d.notifier.status(reason)
            return
        log.info("%s: resumed by its owner; taking part again", d.device)
        d.refused = {t: why for t, why in d.refused.items() if not why.startswith(PAUSED)}
        d.link.publish_status()
        d.notifier.status("resumed by its owner")
        for task, ann in list(self.last_ann.items()):
            state = d.tasks.get(task)
            if state is not None and state.answered == (ann.round, ann.phase):
                continue  # answered before the pause: resending it now would only be refused as a replay
            self.answer(ann)

    def answer(self, ann: Announcement) -> None:
        """``on_announcement`` for a call from the loop itself: a malformed one is logged, not raised."""
        try:
            self.d.on_announcement(ann)
        except (codec.WireError, ValueError, KeyError) as exc:
            log.warning("%s: task %s: %s", self.d.device, ann.task, exc)

    def _parse(self, topic: str) -> topics.Topic:
        """``topics.parse_topic``, once per topic: a device hears the same few topics every round
        (a swarm's thousands of devices parsed each twice per round).  ``WireError`` is not kept."""
        parsed = self._topics.get(topic)
        if parsed is None:
            parsed = topics.parse_topic(topic)
            if len(self._topics) >= _TOPICS_KEPT:
                self._topics.clear()
            self._topics[topic] = parsed
        return parsed

    def handle(self, topic: str, payload: bytes) -> None:
        """Act on one downlink message; malformed input is logged and dropped."""
        d = self.d
        try:
            parsed = self._parse(topic)
            if parsed.kind in _SECAGG:
                if (parsed.fleet, parsed.kind, parsed.device) == (d.config.fleet, "secagg_down", d.device):
                    where = secagg_wire.SecAggTopic("down", parsed.fleet, str(parsed.task), d.device)
                    d.secagg.handle(where, payload)
                return
            if parsed.fleet != d.config.fleet:
                return
            if parsed.kind != "roll_call":  # a roll call may be `fleet status` or the console's
                d.link.heard()
            if parsed.kind == "roll_call":  # the aggregator (re)connected: say where this device stands
                d.link.publish_status()
            elif parsed.kind in ("model_offer", "model_chunk"):
                self._model(parsed, payload)
            elif parsed.kind == "scaling":
                task = str(parsed.task)
                if d.fleet_stats.take(task, payload) and task in self.last_ann:
                    d.on_announcement(self.last_ann[task])  # the round that waited for the transform
            elif parsed.kind in ("down", "down_device") and not d.link.delivered.duplicate(
                parsed.kind, payload
            ):
                # (a duplicate is a restated copy of an announcement this connection already brought)
                ann = d.announcements.decode(topic, payload, d.config.max_payload_bytes)
                if ann.task != parsed.task or ann.fleet != parsed.fleet:
                    raise codec.WireError(f"announcement for {ann.fleet}/{ann.task} on topic {topic}")
                d.on_announcement(ann)
        except (codec.WireError, ValueError, KeyError) as exc:
            log.warning("%s dropped downlink on %s: %s", d.device, topic, exc)

    def _model(self, parsed: topics.Topic, payload: bytes) -> None:
        """A model push's offer or chunk (``edge.models``); the status when the active set changed."""
        models = self.d.models
        if models is None or parsed.model is None:
            return
        if parsed.kind == "model_offer":
            changed = models.handle_offer(parsed.model, payload)
        else:
            changed = models.handle_chunk(parsed.model, int(parsed.version), int(parsed.index), payload)
        if changed:
            self.d.link.publish_status()

"""Uplinks: where a fleet's rounds get their uploads (its intake), and each task's queue of them.

Tasks may collect side by side, each on its own thread, over the one session: whichever
collecting thread holds the pump reads the session, keeps the statuses and hands each
uplink to its task's queue (:meth:`TaskQueues.next_message`), so no thread is added and one task
alone reads the session as it always did.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from cloud_aggregator.rounds.collector import RoundCollector
from cloud_aggregator.rounds.types import CollectRequest
from ioft_protocol import codec, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message

log = logging.getLogger(__name__)

#: A topic is parsed once per device, not three times per message (routing, the task's queue, handling).
parse_topic = functools.lru_cache(maxsize=1 << 15)(topics.parse_topic)


class Fleet(Protocol):
    """What uplinks need of their fleet (``cloud_aggregator.serve.mqtt_fleet.MqttFleet``)."""

    session: MqttSession
    selections: Mapping[str, object]
    intake: DeviceUploads

    def handle(self, msg: Message, rnd: RoundCollector | None = None) -> None: ...

    def _is_uplink(self, topic: str) -> bool: ...

    def _route(self, msg: Message) -> None: ...


class DeviceUploads:
    """Where an :class:`MqttFleet`'s rounds get their uploads: from the devices, on the uplink, each
    admitted by the fleet itself.  ``cloud_aggregator.serve.coordinator.WorkerBatches`` is the other
    intake: batches of uploads its workers admitted."""

    #: The fleet folds the uploads itself (the round engine cuts weights after the round).
    folds_elsewhere = False
    #: Messages it takes before the fleet looks at them (:meth:`handle`): none, here.
    takes_messages = False

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    @staticmethod
    def is_uplink(topic: str) -> bool:
        try:
            return parse_topic(topic).kind in ("up", "secagg_up")  # routed to the task's queue
        except codec.WireError:
            return False

    def routes_to(self, topic: str) -> str | None:
        """The task whose queue takes an uplink on ``topic`` (``None``: none)."""
        try:
            task = parse_topic(topic).task
        except codec.WireError:
            return None
        # Another aggregator's task, or none: not ours to judge.
        selections = self.fleet.selections
        return task if not selections or task in selections else None

    def route(self, msg: Message) -> str | None:
        """The task whose queue ``msg`` waits in (``None``: it is dropped)."""
        return self.routes_to(msg.topic)

    def handle(self, msg: Message, rnd: RoundCollector | None) -> bool:
        """Nothing to take here: the fleet admits a device's upload itself (``False``)."""
        return False

    def opened(self, request: CollectRequest) -> contextlib.AbstractContextManager:
        """Around a round's collecting."""
        return contextlib.nullcontext()

    def before_next(self, task: str, timeout: float) -> float:
        """Before a round waits for its next message: how long it may wait."""
        return timeout

    def wait_ready(self) -> None:
        """Before the fleet waits for its devices."""


class TaskQueues:
    """Each task's uplinks, waiting for its collecting thread (or its first round); the thread
    that holds the pump reads the session for every task."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.session = fleet, fleet.session
        self._queues: dict[str, queue.Queue[Message]] = {}  # task -> its uplinks
        self._pump = threading.Lock()  # held by the thread reading the session

    def queue(self, task: str) -> queue.Queue[Message]:
        q = self._queues.get(task)
        if q is None:
            limit = getattr(getattr(self.session, "inbound", None), "maxsize", 0) or 10_000
            q = self._queues.setdefault(task, queue.Queue(limit))  # bounded like the session's
        return q

    def route(self, msg: Message) -> None:
        """Queue an uplink for its task's thread (the fleet's intake says which, or drops it)."""
        task = self.fleet.intake.route(msg)
        if task is None:
            return
        try:
            self.queue(task).put_nowait(msg)
        except queue.Full:
            log.error("task %s: uplink queue full; dropped an uplink on %s", task, msg.topic)

    def next_message(self, task: str, timeout: float) -> Message | None:
        """The next message for ``task``'s round: an uplink of the task, or a status (already kept).

        The thread that gets the pump reads the session for every task; the others wait on their queue.
        An uplink of the pump holder's own task goes straight to it, in arrival order: its queue is
        empty then (looked at once the pump is held: only the pump holder fills the queues).
        """
        timeout = self.fleet.intake.before_next(task, timeout)
        mine = self.queue(task)
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
            if not self.fleet._is_uplink(msg.topic):
                return msg  # a status (or stray topic): the caller's handle() keeps it
            if self.fleet.intake.routes_to(msg.topic) == task:
                return msg
            self.fleet._route(msg)

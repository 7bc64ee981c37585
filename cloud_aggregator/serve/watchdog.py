"""``serve`` under systemd's watchdog: the pings come from the loops that read the broker.

Every round loop (:meth:`cloud_aggregator.serve.mqtt_fleet.MqttFleet.collect`, the start-up
wait for devices) reads the aggregator's session at least every 0.2 s, so a read is the
proof that a loop turns: :class:`WatchedSession` pings on each (at most every third of
the watchdog, :class:`ioft_protocol.service.Notifier`).  A loop stuck in aggregation or a
store write stops reading and, after ``WatchdogSec=``, systemd restarts ``serve``, which
resumes from its last completed round.  Between tasks ``serve --service`` waits for a
reload; :func:`wait_pinging` keeps that wait a loop that pings.
"""

from __future__ import annotations

import queue
from typing import TypeVar

from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.mqtt_options import SessionOptions
from ioft_protocol.service import Notifier

T = TypeVar("T")


class WatchedSession(MqttSession):
    """The aggregator's session: each read from it is a watchdog ping."""

    def __init__(self, options: SessionOptions, notifier: Notifier) -> None:
        super().__init__(options)
        self.notifier = notifier

    def get(self, timeout: float | None) -> Message | None:
        self.notifier.alive()
        return super().get(timeout)


def wait_pinging(q: queue.Queue[T], notifier: Notifier) -> T:
    """``q.get()``, pinging the watchdog while it waits (without one: simply ``q.get()``)."""
    every_s = notifier.ping_every_s
    while True:
        notifier.alive()
        try:
            return q.get(timeout=every_s)
        except queue.Empty:
            continue

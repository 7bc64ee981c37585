"""A fleet's round announcements: published retained, published again after a broker restart
(the retained copy may be gone), and restated on a device's own downlink when it comes online on a
connection not seen before (``ioft_protocol.restate``: the retained one may not reach it)."""

from __future__ import annotations

import logging
from dataclasses import replace

from ioft_protocol import restate, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import MqttError
from ioft_protocol.round_messages import Announcement
from trainer_lite.params import Params, param_hash

log = logging.getLogger(__name__)

#: Seconds an announcement waits for the broker's ack (a crash right after it must not lose it);
#: without one the round goes on: the broker gets it once the connection is back.
ANNOUNCE_ACK_S = 10.0


class Announcer:
    """The announcements of ``fleet``'s tasks on ``session``."""

    def __init__(self, session: MqttSession, fleet: str) -> None:
        self.session, self.fleet = session, fleet
        self.published: dict[str, list[tuple[str, bytes]]] = {}  # task -> its retained messages
        self._links: dict[str, tuple | None] = {}  # device -> the connection its last status came from
        #: task -> how many announcements it has published; (device, task) -> the one last restated
        self._serial: dict[str, int] = {}
        self._restated: dict[tuple[str, str], int] = {}
        #: restatements not sent: that device already had the task's current announcement restated
        self.restates_skipped = 0
        session.on_connect_hooks.append(self.republish)

    def publish(self, ann: Announcement, downlinks: dict[str, Params]) -> None:
        """Publish ``ann`` (retained), and each device's personalized copy of it from ``downlinks``;
        wait for the broker's ack while it is connected."""
        task = ann.task
        published = [(topics.topic_down(self.fleet, task), ann.encode())]
        for device, params in downlinks.items():
            personal = replace(
                ann, params=params, params_hash=param_hash(params), for_device=device, downlink=None
            )
            published.append((topics.topic_down_device(self.fleet, task, device), personal.encode()))
        self.published[task] = published
        self._serial[task] = self._serial.get(task, 0) + 1
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
                ann.round,
                exc,
            )

    def republish(self) -> None:
        """After a broker restart the retained announcements may be gone: publish them again."""
        for published in list(self.published.values()):
            for topic, payload in published:
                self.session.publish(topic, payload, retain=True, timeout=None)

    def restate(self, device: str, status: dict) -> None:
        """A device online on a connection not seen before gets each task's current announcement
        on its own downlink: the retained one may not reach it (``ioft_protocol.restate``).

        At most once per connection and per announcement: a device that reconnects (or claims to,
        with a new ``connected_at`` in every status) as fast as it can gets one copy per round."""
        link = restate.connection(status)
        known = self._links.get(device)
        self._links[device] = link
        if link is None or link == known:
            return
        for task, published in list(self.published.items()):
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

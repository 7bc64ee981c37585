"""The device's session and its retained status: what it says, when, and whether its aggregator answers.

:class:`DeviceLink` makes the MQTT session (its Last Will says ``offline``; every connect
publishes the ``online`` status and Home Assistant's configs), subscribes to the fleet's
downlinks, publishes the retained status when :class:`edge.status_clock.StatusClock` says it is
due, and says once when no aggregator of the device's fleet has answered.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from edge.config import DeviceConfig
from edge.device_status import StatusSource, status_body
from edge.status_clock import StatusClock
from ioft_protocol import restate, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import SessionOptions
from ioft_protocol.secagg import transport as secagg_wire
from ioft_protocol.service import Notifier

log = logging.getLogger(__name__)


class DeviceLink:
    """One device's link to its fleet (see the module docstring).

    Parameters
    ----------
    source
        What the status reports (the daemon).
    config
        The device's config.
    notifier
        systemd's notifier (the status line says what the device waits for).
    discovery
        Home Assistant's config messages, published on every connect.
    session_factory
        Makes the MQTT session (``edge.swarm`` passes one driven by its shared loop).
    """

    def __init__(
        self,
        source: StatusSource,
        config: DeviceConfig,
        notifier: Notifier,
        discovery: Callable[[], list[tuple[str, bytes]]],
        session_factory: Callable[[SessionOptions], MqttSession],
    ) -> None:
        self.source, self.config, self.notifier, self.discovery = source, config, notifier, discovery
        self.device = config.device
        self.clock = StatusClock(config.round_status_s, config.heartbeat_s, config.aggregator_quiet_s)
        #: announcements handled on this connection, and when it began (``ioft_protocol.restate``)
        self.delivered = restate.Delivered()
        self.connected_at: float | None = None
        #: what the device says while no aggregator of its fleet answers (also in its status)
        self.unheard: str | None = None
        self.session = session_factory(self.options())  # its Last Will reads serving's state

    def status(self, state: str) -> tuple[str, bytes]:
        """The retained status message as ``state`` (``"online"``, or ``"offline"``)."""
        body = status_body(self.source, state, self)
        return topics.topic_status(self.config.fleet, self.device), json.dumps(body, sort_keys=True).encode()

    def options(self) -> SessionOptions:
        c = self.config
        return SessionOptions.for_login(
            c,
            f"ioft-{c.fleet}-{c.device}",
            keepalive=c.keepalive,
            will=self.status("offline"),
            birth=self.birth,
        )

    def birth(self) -> list[tuple[str, bytes]]:
        """The status published on every (re)connect, from a new connection (``ioft_protocol.restate``)."""
        self.connected_at = time.time()
        self.clock.born()  # this status counts as the heartbeat's too
        self.delivered.connected()
        return [self.status("online"), *self.discovery()]  # and Home Assistant's configs, opt-in

    def subscribe(self, models: bool) -> None:
        """The fleet's downlinks to this device (``models``: the model pushes too)."""
        fleet, session = self.config.fleet, self.session
        session.subscribe(topics.topic_down_all(fleet))
        session.subscribe(topics.topic_down_device(fleet, topics.ANY, self.device))
        session.subscribe(secagg_wire.topic_down_mine(fleet, self.device))
        session.subscribe(topics.topic_roll_call(fleet))
        session.subscribe(topics.topic_scaling_all(fleet))  # tasks with scaling = "fleet"
        if models:
            session.subscribe(topics.topic_model_offer_all(fleet))

    def publish_status(self) -> None:
        topic, status = self.status("online")
        self.session.publish(topic, status, retain=True, timeout=None)
        self.clock.sent()

    def round_status(self) -> None:
        """The status after an answered round: at once, or, within ``round_status_s`` of the last
        one, from :meth:`tick` once that has passed (:meth:`StatusClock.round_answered`)."""
        if self.clock.round_answered():
            self.publish_status()

    def tick(self, changed: bool) -> None:
        """Once a second: the status, if anything ``changed``, rounds were answered since the last
        one, or the heartbeat is due (the aggregator waits only for devices heard lately)."""
        clock = self.clock
        if changed or clock.rounds_due() or clock.heartbeat_due(self.session.connected.is_set()):
            self.publish_status()

    def presence(self, online: bool) -> None:
        """A simulated departure or return (``[simulate]``): the retained status says so."""
        topic, status = self.status("online" if online else "offline")
        self.session.publish(topic, status, retain=True, timeout=None)
        log.info("%s: %s (simulated churn)", self.device, "back online" if online else "left the fleet")

    def check_heard(self) -> None:
        """Say once, within ``aggregator_quiet_s`` of connecting, that no aggregator of this
        device's fleet has answered (a wrong ``fleet =`` fails silently otherwise)."""
        if self.unheard is not None or not self.clock.quiet_too_long():
            return
        c = self.config
        self.unheard = (
            f"no aggregator of fleet {c.fleet!r} has answered in {c.aggregator_quiet_s:g} s (no round "
            f"announcement on {c.broker}): check that `fleet =` in device.toml is the "
            "aggregator's fleet (its aggregator.toml) and that `cloud-aggregator serve` is running"
        )
        log.warning("%s: %s", self.device, self.unheard)
        self.notifier.status(self.unheard)
        self.publish_status()

    def heard(self) -> None:
        """A message from the fleet's side arrived: its aggregator is there."""
        if self.clock.heard() and self.unheard is not None:
            self.unheard = None
            log.info("%s: the aggregator of fleet %r answered", self.device, self.config.fleet)
            self.publish_status()

"""The console's live inputs: the devices' retained statuses over MQTT, and the store on disk.

One MQTT session of its own (the operator's login, its own client id) follows
``status/+`` and the broker's byte counters (``$SYS``); a thread drains it into a map
(:func:`cloud_aggregator.console.fleet_status.take_status`, as ``fleet status`` does).  The store
is re-read only when the aggregator has committed since the last read.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from cloud_aggregator.console.fleet_status import take_status
from cloud_aggregator.console.fleet_view import FleetView, StoreData, read_store, store_signature
from cloud_aggregator.console.machines_feed import MachineLog
from cloud_aggregator.operator import claim_operator_login, revoked_devices
from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.mqtt_options import BrokerLogin

log = logging.getLogger(__name__)

#: mosquitto's byte counters (published every ``sys_interval``, 10 s by default).
SYS_BYTES = {"$SYS/broker/bytes/received": "bytes_received", "$SYS/broker/bytes/sent": "bytes_sent"}


class StatusFeed:
    """The latest retained status of each device, kept current on a thread of its own."""

    def __init__(self, login: BrokerLogin, fleet: str) -> None:
        self.fleet = fleet
        options, self.slot = claim_operator_login(login, "console")  # held while the console runs
        self.session = MqttSession(options)
        self._statuses: dict[str, dict] = {}
        #: The devices' answers and alert events (the machines view), over this same session.
        self.machines = MachineLog(fleet)
        self._broker: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="console-status", daemon=True)
        #: Bumped on every change, so readers can tell whether anything is new.
        self.version = 0

    def start(self) -> None:
        """Subscribe and connect in the background (retrying forever, as a daemon does)."""
        self.session.subscribe(topics.topic_status_all(self.fleet))
        for topic in self.machines.subscriptions():
            self.session.subscribe(topic)
        # The devices' answers bring the statuses where the broker withholds retained ones (ioft_protocol.restate).
        roll_call = topics.topic_roll_call(self.fleet)
        self.session.on_connect_hooks.append(lambda: self.session.publish(roll_call, b"", timeout=None))
        for topic in SYS_BYTES:
            self.session.subscribe(topic, qos=0)  # refused by a strict ACL: then no byte counts
        self.session.start(timeout=None)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.session.stop()

    def snapshot(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Copies of ``({device: status}, broker counters)``."""
        with self._lock:
            return dict(self._statuses), dict(self._broker)

    def take(self, msg: Message) -> None:
        """Apply one message (also how tests feed it)."""
        with self._lock:
            if msg.topic in SYS_BYTES:
                try:
                    self._broker[SYS_BYTES[msg.topic]] = float(msg.payload)
                except ValueError:
                    return
            elif self.machines.follows(msg.topic):
                if not self.machines.take(msg):
                    return
            elif not msg.payload:  # a cleared retained status: the device left the fleet
                parsed = topics.parse_topic(msg.topic)
                if self._statuses.pop(parsed.device, None) is None:
                    return
            elif not take_status(self._statuses, msg):
                return
            self.version += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self.session.get(0.2)
            if msg is None:
                continue
            try:
                self.take(msg)
            except ValueError as exc:  # a topic that does not parse
                log.warning("ignoring %s: %s", msg.topic, exc)


class ViewSource:
    """Builds :class:`FleetView`s, re-reading the store only when the aggregator has written to it."""

    def __init__(self, db: Path, feed: StatusFeed | None, fleet: str, fleet_dir: Path | None = None) -> None:
        self.db = db
        self.feed = feed
        self.fleet = fleet
        #: The ``fleet init`` folder whose CRL says which devices are revoked (``None``: unknown).
        self.fleet_dir = fleet_dir
        self._lock = threading.Lock()
        self._signature: tuple | None = None
        self._store = StoreData()

    def view(self) -> FleetView:
        with self._lock:
            signature = store_signature(self.db)
            if signature != self._signature:
                self._store = read_store(self.db)
                self._signature = signature
            store = self._store
        statuses, broker = self.feed.snapshot() if self.feed is not None else ({}, {})
        revoked = revoked_devices(self.fleet_dir) if self.fleet_dir is not None else set()
        return FleetView(self.fleet, store, statuses, broker, taken=time.time(), revoked=revoked)

    def version(self) -> tuple:
        """Changes when the store or a status changes (cheap: a stat and a counter)."""
        return (store_signature(self.db), self.feed.version if self.feed is not None else 0)

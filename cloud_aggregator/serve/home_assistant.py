"""Home Assistant's discovery configs, published from the trusted side.

A device announces its entities on its own topic (``ioft/v1/<fleet>/ha/<device>/<component>/<object>``,
:mod:`edge.serving.home_assistant`; the fleet's ACL lets it write only its own and nothing under
Home Assistant's prefix).  The broker cannot check a payload, so a device could name another
machine's identifiers and put its entities on that machine's card.  ``serve`` republishes each
config rebuilt instead: the ``device`` block and ``unique_id`` name the publishing device, every
topic the entity reads must be one of that device's own (its status, answers and alerts), and
only keys Home Assistant documents for a read-only sensor pass.  They go, retained, to
``homeassistant/<component>/<fleet>_<device>/<object>/config``: the node id carries the fleet, so
two fleets whose device ids repeat do not collide on one Home Assistant.  An empty config (the
device dropped an entity) empties the republished one, which removes the entity.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ioft_protocol import codec, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message

log = logging.getLogger(__name__)

PREFIX = topics.DISCOVERY_PREFIX
COMPONENTS = ("sensor", "binary_sensor")
#: A config larger than this is not a config (ours are about 1 KB).
MAX_CONFIG_BYTES = 16 * 1024
#: The keys of a read-only entity that pass; the identity keys are rebuilt here.
PASSED = frozenset({
    "name", "state_topic", "value_template", "unit_of_measurement", "state_class", "device_class",
    "suggested_display_precision", "options", "payload_on", "payload_off", "availability", "qos",
    "json_attributes_topic", "json_attributes_template", "icon", "entity_category", "expire_after",
})  # fmt: skip
AVAILABILITY_KEYS = ("topic", "value_template", "payload_available", "payload_not_available")
DEVICE_KEYS = ("model", "sw_version")
#: Seconds between two warnings about one device's refused configs.
WARN_EVERY_S = 60.0


def discovery_topic(fleet: str, device: str, component: str, object_id: str, prefix: str = PREFIX) -> str:
    """Where Home Assistant reads the config (node id ``<fleet>_<device>``)."""
    return f"{prefix}/{component}/{fleet}_{device}/{object_id}/config"


def _owned(fleet: str, device: str, topic: object) -> bool:
    """Whether ``topic`` is one the device itself publishes (so the entity shows the device's own state)."""
    if not isinstance(topic, str):
        return False
    try:
        parsed = topics.parse_topic(topic)
    except codec.WireError:
        return False
    return parsed.fleet == fleet and parsed.device == device and parsed.kind in ("status", "answer", "alert")


def rebuild(fleet: str, device: str, component: str, object_id: str, payload: bytes) -> dict[str, Any]:
    """The config Home Assistant gets for ``device``'s ``payload``: its identity set here.

    Raises
    ------
    ValueError
        Saying what is wrong with the payload (not JSON, a topic of another device, ...).
    """
    if len(payload) > MAX_CONFIG_BYTES:
        raise ValueError(f"{len(payload)} bytes, over {MAX_CONFIG_BYTES}")
    body = json.loads(payload)
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    config = {k: v for k, v in body.items() if k in PASSED}
    if not isinstance(config.get("name"), str) or len(config["name"]) > 100:
        raise ValueError("no name of at most 100 characters")
    reads = [config.get("state_topic"), config.get("json_attributes_topic")]
    availability = config.get("availability", [])
    if not isinstance(availability, list) or not all(isinstance(a, dict) for a in availability):
        raise ValueError("availability is not a list of objects")
    config["availability"] = [{k: a[k] for k in AVAILABILITY_KEYS if k in a} for a in availability]
    reads += [a.get("topic") for a in availability]
    foreign = [t for t in reads if t is not None and not _owned(fleet, device, t)]
    if config.get("state_topic") is None or foreign:
        raise ValueError(
            f"it reads {foreign or 'no state topic'}, not {device}'s own status, answers or alerts"
        )
    given = body.get("device") if isinstance(body.get("device"), dict) else {}
    config["device"] = {
        "identifiers": [f"ioft_{fleet}_{device}"],
        "name": device,
        "manufacturer": "ioft",
        **{k: given[k][:64] for k in DEVICE_KEYS if isinstance(given.get(k), str)},
    }
    config["unique_id"] = f"ioft_{fleet}_{device}_{object_id}"
    config["origin"] = {"name": "ioft"}
    return config


class DiscoveryRelay:
    """Republishes the devices' discovery configs, rebuilt, where Home Assistant reads them."""

    def __init__(self, session: MqttSession, fleet: str, prefix: str = PREFIX) -> None:
        self.session, self.fleet, self.prefix = session, codec.check_id("fleet", fleet), prefix
        self.published = self.refused = 0
        self._warned: dict[str, float] = {}

    def attach(self) -> None:
        """Subscribe and handle the configs on the session's network thread (they never queue)."""
        mine = topics.topic_discovery_all(self.fleet)
        self.session.tap(mine, self.handle)
        self.session.subscribe(mine)

    def handle(self, msg: Message) -> bool:
        parts = msg.topic.split("/")
        try:
            device, component, object_id = parts[4], parts[5], parts[6]
            codec.check_id("device", device)
            codec.check_id("object", object_id)
            if len(parts) != 7 or component not in COMPONENTS:
                raise codec.WireError(f"component {component!r} is not one of {', '.join(COMPONENTS)}")
        except (IndexError, codec.WireError) as exc:
            self._refuse(parts[4] if len(parts) > 4 else "?", msg.topic, str(exc))
            return True
        out = discovery_topic(self.fleet, device, component, object_id, self.prefix)
        if not msg.payload:  # the device dropped the entity: Home Assistant removes it
            self.session.publish(out, b"", retain=True, timeout=None)
            return True
        try:
            config = rebuild(self.fleet, device, component, object_id, msg.payload)
        except ValueError as exc:
            self._refuse(device, msg.topic, str(exc))
            return True
        self.session.publish(out, json.dumps(config, sort_keys=True).encode(), retain=True, timeout=None)
        self.published += 1
        return True

    def _refuse(self, device: str, topic: str, why: str) -> None:
        """Count a refused config; warn about it at most once a minute per device."""
        self.refused += 1
        now = time.monotonic()
        if now - self._warned.get(device, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[device] = now
            log.warning("Home Assistant config %r refused (%d so far): %s", topic, self.refused, why)

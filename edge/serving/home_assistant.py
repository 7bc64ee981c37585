"""Home Assistant MQTT discovery: each machine shows up as a device with its condition and advice.

Opt-in (``[serve] home_assistant = true``).  The device publishes one retained config message per
entity on its own ``ioft/v1/<fleet>/ha/<device>/<component>/<object_id>`` (the fleet's ACL lets
each device write only its own, and none under Home Assistant's prefix).  The aggregator, the
trusted side, republishes each one rebuilt, naming the device that published it, under
``homeassistant/<component>/<fleet>_<device>/<object_id>/config``
(:mod:`cloud_aggregator.serve.home_assistant`): a device cannot put its entities on another
machine's card.  The entities read the topics the device already publishes, with a
``value_template`` each, so nothing new goes on the wire per answer:

- per printer task (answers carry ``expected_speed``): the expected speed and the residual of the
  latest layer, the speed advice (with ``[serve] vibration_budget``), the field error;
- per welder task (answers carry ``classes``): the top class of the latest weld and its
  probability, the field accuracy;
- per alert rule: a ``binary_sensor`` (device class ``problem``), on while the alert is open
  (the retained ``alert/<device>/<rule>`` message; unknown until the rule first raises).

Availability comes from the device's retained status (``online``; its Last Will says
``offline``).  The configs go out when a task first gets a serving model and again on every
(re)connect, so a broker that lost its retained messages learns them back.  Keys are spelled out
in full (no abbreviations); ``tests/edge/test_home_assistant.py`` checks them against the keys
Home Assistant documents.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge.config import DeviceConfig
from edge.config_serve import AlertRule
from ioft_protocol import topics

log = logging.getLogger(__name__)

MANUFACTURER = "ioft"


def _version() -> str:
    try:
        return importlib.metadata.version("ioft")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def label(task: str, what: str) -> str:
    """An entity's name: the task, then what it shows, without saying a word twice ("speed advice"
    for task ``speed``, not "speed speed advice")."""
    return what if task in what.split() else f"{task} {what}"


def _field_template(task: str, scale: float) -> str:
    """The status's ``serving.field.<task>.value`` times ``scale``; ``None`` (unknown) until scored."""
    return (
        "{% set f = ((value_json.serving or {}).get('field') or {}).get('" + task + "') or {} %}"
        "{{ none if f.get('value') is none else (f.get('value') * " + repr(scale) + ") | round(2) }}"
    )


class Discovery:
    """The discovery messages of one device (see the module docstring)."""

    def __init__(self, config: DeviceConfig) -> None:
        self.config = config
        self.fleet, self.device = config.fleet, config.device
        version = _version()
        self.device_block = {
            "identifiers": [f"ioft_{self.fleet}_{self.device}"],
            "name": self.device,
            "model": config.machine_kind or "machine",  # printer or welder (kind, [sensors] kind)
            "manufacturer": MANUFACTURER,
            "sw_version": version,
        }
        self.origin = {"name": MANUFACTURER, "sw_version": version}
        self.availability = [
            {
                "topic": topics.topic_status(self.fleet, self.device),
                "value_template": "{{ value_json.state }}",
                "payload_available": "online",
                "payload_not_available": "offline",
            }
        ]

    def topic(self, component: str, object_id: str) -> str:
        return topics.topic_discovery(self.fleet, self.device, component, object_id)

    def _entity(self, component: str, object_id: str, name: str, body: dict[str, Any]) -> tuple[str, bytes]:
        payload = {
            "name": name,
            "unique_id": f"ioft_{self.fleet}_{self.device}_{object_id}",
            "device": self.device_block,
            "origin": self.origin,
            "availability": self.availability,
            "qos": 1,
            **body,
        }
        return self.topic(component, object_id), json.dumps(payload, sort_keys=True).encode()

    def task(self, task: str, classes: list[str] | None, advice: bool) -> list[tuple[str, bytes]]:
        """The sensors of one serving task: a printer's (``classes`` None) or a welder's."""
        answer = topics.topic_answer(self.fleet, self.device, task)
        status = topics.topic_status(self.fleet, self.device)
        speed = {"state_topic": answer, "unit_of_measurement": "mm/s", "state_class": "measurement",
                 "suggested_display_precision": 1}  # fmt: skip
        if classes is None:
            out = [
                self._entity("sensor", f"{task}_expected_speed", label(task, "expected speed"),
                             speed | {"value_template": "{{ value_json.expected_speed | round(2) }}"}),
                self._entity("sensor", f"{task}_residual", label(task, "residual"),
                             speed | {"value_template": "{{ value_json.residual | round(2) }}"}),
                self._entity("sensor", f"{task}_field_error", label(task, "field error"),
                             speed | {"state_topic": status, "value_template": _field_template(task, 1.0)}),
            ]  # fmt: skip
            if advice:
                tpl = "{{ value_json.advice.speed if value_json.advice is defined else none }}"
                out.append(self._entity("sensor", f"{task}_speed_advice", label(task, "speed advice"),
                                        speed | {"value_template": tpl}))  # fmt: skip
            return out
        percent = {"unit_of_measurement": "%", "state_class": "measurement", "suggested_display_precision": 1}
        return [
            self._entity("sensor", f"{task}_class", label(task, "class"),
                         {"state_topic": answer, "device_class": "enum", "options": list(classes),
                          "value_template": "{{ value_json.predicted }}"}),
            self._entity("sensor", f"{task}_probability", label(task, "probability"),
                         percent | {"state_topic": answer,
                                    "value_template": "{{ (100 * (value_json.probabilities | max)) | round(2) }}"}),
            self._entity("sensor", f"{task}_field_accuracy", label(task, "field accuracy"),
                         percent | {"state_topic": status, "value_template": _field_template(task, 100.0)}),
        ]  # fmt: skip

    def alert(self, rule: AlertRule) -> tuple[str, bytes]:
        """A rule's ``binary_sensor``: on while its alert is open; named by its ``action`` when it has
        one, and the alert message (``action``, the class's ``meaning``) as its attributes."""
        topic = topics.topic_alert(self.fleet, self.device, rule.name)
        return self._entity(
            "binary_sensor",
            f"alert_{rule.name}",
            _shorten(f"alert {rule.name}" + (f": {rule.action}" if rule.action else "")),
            {
                "state_topic": topic,
                "json_attributes_topic": topic,
                "value_template": "{{ value_json.state }}",
                "payload_on": "raised",
                "payload_off": "cleared",
                "device_class": "problem",
            },
        )


def _shorten(name: str, limit: int = 100) -> str:
    """A name ``serve`` passes on (at most ``limit`` characters; the attributes keep the whole text)."""
    return name if len(name) <= limit else name[: limit - 1].rstrip() + "…"


#: The Home Assistant config topics last announced: a later start empties those gone since.
ANNOUNCED = "home-assistant.json"


class Announcer:
    """Which discovery configs a device sends, and which it sent before (kept in ``folder``).

    ``discovery`` is ``None`` where Home Assistant is off: every config announced before is then
    emptied at the next connect, so Home Assistant removes the entities.
    """

    def __init__(self, discovery: Discovery | None, folder: Path, device: str, advice: bool) -> None:
        self.discovery, self.folder, self.device = discovery, Path(folder), device
        self.advice = advice  # [serve] vibration_budget is set: printer tasks advise

    def task(self, task: str, classes: list[str] | None) -> list[tuple[str, bytes]]:
        """A task's configs (none where Home Assistant is off)."""
        if self.discovery is None:
            return []
        return self.discovery.task(task, classes, self.advice and classes is None)

    def configs(
        self,
        rules: list[AlertRule],
        tasks: dict[str, list[str] | None],
        never_fires: Callable[[AlertRule], bool],
    ) -> list[tuple[str, bytes]]:
        """Every config message (published retained on each connect), and an empty one for each
        entity announced before and gone now (a rule removed from the config, discovery turned
        off): Home Assistant then removes it.  ``tasks``: each serving task's classes."""
        out: list[tuple[str, bytes]] = []
        if self.discovery is not None:
            # A rule its task's model shows can never fire is not announced (nor kept, if it was).
            out = [self.discovery.alert(r) for r in rules if not never_fires(r)]
            for task, classes in tasks.items():
                out += self.task(task, classes)
        now = {t for t, _ in out}
        gone = sorted(self._announced() - now)
        self._remember(now)
        return out + [(t, b"") for t in gone]

    def first_model(self, task: str, classes: list[str] | None) -> list[tuple[str, bytes]]:
        """A task's first serving model: its configs, to publish now rather than at the next connect."""
        if self.discovery is None:
            return []
        configs = self.task(task, classes)
        self._remember(self._announced() | {t for t, _ in configs})
        return configs

    def _announced(self) -> set[str]:
        """The config topics this device announced last (``serving/home-assistant.json``)."""
        try:
            return {str(t) for t in json.loads((self.folder / ANNOUNCED).read_text())}
        except (OSError, ValueError, TypeError):
            return set()

    def _remember(self, announced: set[str]) -> None:
        path = self.folder / ANNOUNCED
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(announced)))
            tmp.replace(path)
        except OSError as exc:  # the next start re-announces everything anyway; only removals are lost
            log.warning("%s: could not record the Home Assistant configs in %s: %s", self.device, path, exc)

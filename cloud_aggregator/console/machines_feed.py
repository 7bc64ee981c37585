"""The machines as the console sees them: each device's recent answers, its alerts, its serving block.

The devices publish one message per answer on ``answer/<device>/<task>`` and one per raise or
clear on ``alert/<device>/<rule>`` (``edge.serving``; both QoS 1, the latest retained).  The
console's own MQTT session (:class:`cloud_aggregator.console.feed.StatusFeed`) hands those
messages to a :class:`MachineLog`, which keeps per device a ring of its last :data:`RING`
answers and the latest event of each alert rule.  Memory stays bounded whatever the fleet
sends: at most :data:`MAX_DEVICES` devices, :data:`RING` answers and :data:`MAX_RULES` rules
each, every answer cut to a few numbers and short strings (:class:`Point`).

A device writes its own messages, so every field is type-checked here (the console never
imports ``edge``); what does not parse is counted under ``ignored`` and otherwise dropped.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from cloud_aggregator.console.fleet_status import number
from ioft_protocol import topics
from ioft_protocol.mqtt_inbound import Message

log = logging.getLogger(__name__)

#: Answers kept per device (across its tasks), oldest dropped first.
RING = 200
#: Devices followed; answers of further ones are counted under ``ignored`` (a broker without an ACL).
MAX_DEVICES = 2000
#: Alert rules followed per device (a device's ``[[serve.alerts]]``), the same for tasks per device.
MAX_RULES = 64
#: Classes kept per weld answer (the welder's targets have 2 to 4).
MAX_CLASSES = 16
#: Longest device-written string kept (row keys, class names, digests).
MAX_TEXT = 80
#: Longest operator's text kept (an alert rule's ``action``, a class's meaning; edge.config_serve.MAX_WORDS).
MAX_WORDS = 200


def _text(value: Any) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) and value else None


def _name(value: Any) -> str | None:
    """A string repeated across answers (a digest, a class): one copy however many answers hold it."""
    text = _text(value)
    return sys.intern(text) if text is not None else None


@dataclass(frozen=True, slots=True)
class Point:
    """One answer, cut to what the page and the metrics show."""

    task: str
    key: str
    row_time: float
    answered_at: float
    latency_s: float | None
    expected_speed: float | None
    commanded: float | None
    residual: float | None
    predicted: str | None
    classes: tuple[str, ...] | None
    probabilities: tuple[float, ...] | None
    model_round: int | None
    digest: str | None
    encoder_version: int | None
    advice: float | None

    @classmethod
    def parse(cls, task: str, body: Any) -> Point | None:
        """The answer in ``body`` (an answer message's JSON), or ``None`` if it is not one."""
        if not isinstance(body, dict):
            return None
        key, row_time, answered = (
            _text(body.get("key")),
            number(body.get("row_time")),
            number(body.get("answered_at")),
        )
        if key is None or row_time is None or answered is None:
            return None
        classes, probs = body.get("classes"), body.get("probabilities")
        if (
            isinstance(classes, list)
            and isinstance(probs, list)
            and 0 < len(classes) == len(probs) <= MAX_CLASSES
        ):
            names = tuple(_name(c) or "?" for c in classes)
            values = tuple(number(p) for p in probs)
            kept = (names, tuple(v if v is not None else float("nan") for v in values))
        else:
            kept = (None, None)
        model = body.get("model") if isinstance(body.get("model"), dict) else {}
        advice = body.get("advice")
        round_, enc = model.get("round"), model.get("encoder_version")
        return cls(
            task=task,
            key=key,
            row_time=row_time,
            answered_at=answered,
            latency_s=number(body.get("latency_s")),
            expected_speed=number(body.get("expected_speed")),
            commanded=number(body.get("commanded")),
            residual=number(body.get("residual")),
            # "label": its old name, from a device not upgraded yet (until 0.2.0)
            predicted=_name(body.get("predicted")) or _name(body.get("label")),
            classes=kept[0],
            probabilities=kept[1],
            model_round=round_ if isinstance(round_, int) and not isinstance(round_, bool) else None,
            digest=_name(model.get("digest")),
            encoder_version=enc if isinstance(enc, int) and not isinstance(enc, bool) else None,
            advice=number(advice.get("speed")) if isinstance(advice, dict) else None,
        )

    def probability(self, name: str) -> float | None:
        if self.classes is None or self.probabilities is None or name not in self.classes:
            return None
        return self.probabilities[self.classes.index(name)]

    def to_json(self) -> dict[str, Any]:
        out = {
            "key": self.key,
            "row_time": self.row_time,
            "answered_at": self.answered_at,
            "latency_s": self.latency_s,
            "model": {
                "round": self.model_round,
                "digest": self.digest,
                "encoder_version": self.encoder_version,
            },
        }
        if self.classes is not None:
            out |= {
                "classes": list(self.classes),
                "probabilities": list(self.probabilities or ()),
                "predicted": self.predicted,
            }
        else:
            out |= {
                "expected_speed": self.expected_speed,
                "commanded": self.commanded,
                "residual": self.residual,
            }
        if self.advice is not None:
            out["advice"] = self.advice
        return out


#: The fields of an alert event the console keeps (``edge.serving.alerts.Event``).
ALERT_TEXT = ("task", "state", "key")
ALERT_NUMBERS = ("at", "since", "value", "threshold", "votes", "k", "n")
#: The operator's words an alert event carries: what to do, what the class it reads means.
ALERT_WORDS = ("action", "meaning")


def words(value: Any) -> str | None:
    """An operator's text from a device (``None``: not a string), at most :data:`MAX_WORDS` characters."""
    return value[:MAX_WORDS] if isinstance(value, str) and value else None


def parse_alert(rule: str, body: Any) -> dict[str, Any] | None:
    """An alert event (raise or clear) from a device, cut to known fields; ``None`` if it is not one."""
    if not isinstance(body, dict) or body.get("state") not in ("raised", "cleared"):
        return None
    out: dict[str, Any] = {"rule": rule[:MAX_TEXT]}
    out |= {k: _text(body.get(k)) for k in ALERT_TEXT}
    out |= {k: number(body.get(k)) for k in ALERT_NUMBERS}
    out |= {k: words(body.get(k)) for k in ALERT_WORDS}
    return out if out["at"] is not None else None


class MachineLog:
    """Each device's last answers and alert events, fed by the console's MQTT session; thread-safe."""

    def __init__(self, fleet: str, ring: int = RING, max_devices: int = MAX_DEVICES) -> None:
        self.fleet = fleet
        self.ring, self.max_devices = ring, max_devices
        self._answers: dict[str, deque[Point]] = {}
        self._latest: dict[str, dict[str, Point]] = {}  # device -> task -> its latest answer
        self._alerts: dict[str, dict[str, dict[str, Any]]] = {}  # device -> rule -> latest event
        self._lock = threading.Lock()
        base = topics.fleet_root(fleet) + "/"
        self._prefixes = (base + "answer/", base + "alert/")
        #: Answer and alert messages taken, and those dropped (unparsable, or past a bound).
        self.taken = 0
        self.ignored = 0

    def subscriptions(self) -> list[str]:
        return [topics.topic_answer_all(self.fleet), topics.topic_alert_all(self.fleet)]

    def follows(self, topic: str) -> bool:
        """Whether ``topic`` is an answer or alert topic of this fleet (cheap: a prefix test)."""
        return topic.startswith(self._prefixes)

    def take(self, msg: Message) -> bool:
        """Apply one answer or alert message; ``True`` if it changed what the console shows."""
        try:
            parsed = topics.parse_topic(msg.topic)
            body = json.loads(msg.payload) if msg.payload else None
        except (ValueError, RecursionError):
            self.ignored += 1
            return False
        if parsed.kind == "answer":
            return self._answer(parsed.device, parsed.task, body)
        if parsed.kind == "alert" and parsed.rule is not None:
            return self._alert(parsed.device, parsed.rule, body)
        return False

    def _room(self, device: str, known: dict) -> bool:
        if device in known or len(known) < self.max_devices:
            return True
        if self.ignored == 0 or self.ignored % 1000 == 0:
            log.warning("following %d devices already; ignoring the answers of %s", self.max_devices, device)
        self.ignored += 1
        return False

    def _answer(self, device: str, task: str, body: Any) -> bool:
        point = Point.parse(task, body)
        with self._lock:
            if point is None or not self._room(device, self._answers):
                self.ignored += point is None
                return False
            latest = self._latest.setdefault(device, {})
            last = latest.get(task)
            # The retained answer comes again on every (re)subscribe: once is enough.
            if last is not None and (last.key, last.answered_at) == (point.key, point.answered_at):
                return False
            if task not in latest and len(latest) >= MAX_RULES:
                self.ignored += 1
                return False
            latest[task] = point
            self._answers.setdefault(device, deque(maxlen=self.ring)).append(point)
            self.taken += 1
            return True

    def _alert(self, device: str, rule: str, body: Any) -> bool:
        event = parse_alert(rule, body) if body is not None else None
        with self._lock:
            if not self._room(device, self._alerts):
                return False
            rules = self._alerts.setdefault(device, {})
            if event is None:  # a cleared retained message (the rule left the config), or junk
                self.ignored += body is not None
                return rules.pop(rule, None) is not None
            if rule not in rules and len(rules) >= MAX_RULES:
                self.ignored += 1
                return False
            if rules.get(rule) == event:
                return False
            rules[rule] = event
            self.taken += 1
            return True

    def snapshot(
        self,
    ) -> tuple[dict[str, list[Point]], dict[str, dict[str, Point]], dict[str, dict[str, dict]]]:
        """Copies of ``(answers by device, latest answer by device and task, alert events by device and rule)``."""
        with self._lock:
            return (
                {d: list(ring) for d, ring in self._answers.items()},
                {d: dict(per) for d, per in self._latest.items()},
                {d: {r: dict(e) for r, e in per.items()} for d, per in self._alerts.items()},
            )


def merged_alerts(events: dict[str, dict], status: Any) -> list[dict[str, Any]]:
    """A device's alerts, each rule once: the newer of its last alert message and its entry in the
    device's retained status (``alerts``: the open ones, which survive a restart); open ones first."""
    out = dict(events)
    for entry in status if isinstance(status, list) else []:
        rule = entry.get("rule") if isinstance(entry, dict) else None
        if not isinstance(rule, str) or not rule:
            continue
        parsed = parse_alert(rule, {**entry, "state": "raised"})
        known = out.get(rule[:MAX_TEXT])
        if parsed is not None and (known is None or (known["at"] or 0) < parsed["at"]):
            out[parsed["rule"]] = parsed
    return sorted(out.values(), key=lambda e: (e["state"] != "raised", -(e["at"] or 0), e["rule"]))[
        :MAX_RULES
    ]

"""``push --wait``: each addressed device's answer to a push, read from its retained status.

A device reports model installs in its retained ``status/<device>`` message
(``edge.models.manager.ModelManager.status``: each model's active version and recent refusals
with their reasons); this follows those messages after a push until every device
answered or the time is up.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ioft_protocol import codec, topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message

log = logging.getLogger(__name__)

#: What ``--wait`` says of a device.
INSTALLED, REFUSED, PENDING = "installed", "refused", "pending"


@dataclass(frozen=True)
class DeviceAnswer:
    """One device's answer to a push, read from its retained status."""

    device: str
    state: str  # INSTALLED, REFUSED or PENDING
    detail: str = ""


def answer_of(device: str, status: dict | None, name: str, version: int) -> DeviceAnswer:
    """What ``status`` (a device's retained status body) says about model ``name`` v``version``.

    Installed when that version is active; refused when a refusal of that version is
    listed (a version installed and then rolled back is refused, with the reason);
    otherwise pending (offline, fetching, or not answered yet).  Any field of the wrong
    type counts as no answer: a device writes its own status.
    """
    if not isinstance(status, dict):
        return DeviceAnswer(device, PENDING, "no status")
    models = status.get("models")
    entry = models.get(name) if isinstance(models, dict) else None
    entry = entry if isinstance(entry, dict) else {}
    active = entry.get("active")
    if active == version:
        return DeviceAnswer(device, INSTALLED)
    rejected = entry.get("rejected")
    for r in reversed(rejected if isinstance(rejected, list) else []):
        if isinstance(r, dict) and r.get("version") == version:
            return DeviceAnswer(device, REFUSED, _printable(r.get("reason")))
    if isinstance(active, int) and active > version:
        return DeviceAnswer(device, REFUSED, f"v{active} is active there (newer)")
    if status.get("state") != "online":
        return DeviceAnswer(device, PENDING, "offline")
    transfer = entry.get("transfer")
    if isinstance(transfer, dict) and transfer.get("version") == version:
        return DeviceAnswer(device, PENDING, f"fetching: {transfer.get('have')}/{transfer.get('of')} chunks")
    return DeviceAnswer(device, PENDING, "no answer yet")


def _printable(text: object, limit: int = 300) -> str:
    s = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _note_status(msg: Message, devices: Sequence[str], statuses: dict[str, dict | None]) -> None:
    """Put a status message into ``statuses`` (of ``devices`` only, when given); a bad one is logged."""
    try:
        parsed = topics.parse_topic(msg.topic)
        body = json.loads(msg.payload) if msg.payload else None
    except (codec.WireError, ValueError, RecursionError) as exc:
        log.warning("ignoring status on %s: %s", msg.topic, exc)
        return
    if parsed.kind == "status" and (not devices or parsed.device in statuses):
        statuses[parsed.device] = body if isinstance(body, dict) else None


def wait_for_answers(
    session: MqttSession,
    fleet: str,
    name: str,
    version: int,
    devices: Sequence[str] = (),
    *,
    timeout: float = 120.0,
    settle_s: float = 1.0,
) -> list[DeviceAnswer]:
    """Follow the devices' retained statuses until each addressed device answered, or ``timeout``.

    Parameters
    ----------
    session
        A connected operator session (it may read ``status/+``).
    fleet, name, version
        The push to wait for.
    devices
        The addressed devices; empty: every device with a status (the whole fleet).
    timeout
        Give up after this many seconds; who has not answered by then is pending.
    settle_s
        With no ``devices``, wait at least this long for the retained statuses to arrive.

    Returns
    -------
    list of DeviceAnswer
        One per device, sorted by device id.
    """
    session.subscribe(topics.topic_status_all(fleet))
    statuses: dict[str, dict | None] = dict.fromkeys(devices)
    started = time.monotonic()
    deadline = started + timeout
    while True:
        now = time.monotonic()
        msg = session.get(min(0.1, max(0.0, deadline - now)))
        if msg is not None:
            _note_status(msg, devices, statuses)
            continue
        answers = [answer_of(d, statuses[d], name, version) for d in sorted(statuses)]
        waiting = [a for a in answers if a.state == PENDING and a.detail != "offline"]
        settled = bool(devices) or now - started >= settle_s
        if (settled and not waiting) or now >= deadline:
            session.unsubscribe(topics.topic_status_all(fleet))
            return answers

"""Topic names under ``ioft/v1/<fleet>/`` and their parser (the layout is in the package docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ioft_protocol.codec import WireError, check_id

PROTOCOL = "ioft/v1"
_UINT = re.compile(r"^(0|[1-9][0-9]{0,8})$")


def topic_down(fleet: str, task: str) -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/task/{check_id('task', task)}/down"


def topic_down_all(fleet: str) -> str:
    """Every task's round announcement (the devices and the aggregator workers follow them all)."""
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/task/+/down"


def topic_down_device(fleet: str, task: str, device: str) -> str:
    return f"{topic_down(fleet, task)}/{check_id('device', device)}"


def topic_up(fleet: str, task: str, device: str) -> str:
    return (
        f"{PROTOCOL}/{check_id('fleet', fleet)}/task/{check_id('task', task)}/up/{check_id('device', device)}"
    )


def topic_up_all(fleet: str, task: str = "+") -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/task/{task}/up/+"


def topic_status(fleet: str, device: str) -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/status/{check_id('device', device)}"


def topic_status_all(fleet: str) -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/status/+"


def topic_answer(fleet: str, device: str, task: str) -> str:
    """A device's answers to its new rows for one task (``edge.serving``): QoS 1, the latest retained."""
    return (
        f"{PROTOCOL}/{check_id('fleet', fleet)}/answer/{check_id('device', device)}/{check_id('task', task)}"
    )


def topic_answer_all(fleet: str, device: str = "+") -> str:
    """Every task's answers of ``device`` (default: of every device)."""
    dev = device if device == "+" else check_id("device", device)
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/answer/{dev}/+"


def topic_alert(fleet: str, device: str, rule: str) -> str:
    """One alert rule of a device (``edge.serving.alerts``): a message when it is raised and one
    when it clears, QoS 1, retained (the latest says whether it is open)."""
    return (
        f"{PROTOCOL}/{check_id('fleet', fleet)}/alert/{check_id('device', device)}/{check_id('alert', rule)}"
    )


def topic_alert_all(fleet: str, device: str = "+") -> str:
    """Every alert rule of ``device`` (default: of every device)."""
    dev = device if device == "+" else check_id("device", device)
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/alert/{dev}/+"


def topic_roll_call(fleet: str) -> str:
    """The aggregator asks every device to publish its status again (``ioft_protocol.restate``)."""
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/rollcall"


def topic_model_offer(fleet: str, name: str) -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/model/{check_id('model', name)}/manifest"


def topic_model_offer_all(fleet: str) -> str:
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/model/+/manifest"


def topic_model_chunk(fleet: str, name: str, version: int, index: int) -> str:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise WireError(f"model version must be an int >= 1, got {version!r}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise WireError(f"chunk index must be an int >= 0, got {index!r}")
    return f"{PROTOCOL}/{check_id('fleet', fleet)}/model/{check_id('model', name)}/{version}/chunk/{index}"


@dataclass(frozen=True)
class Topic:
    """A parsed topic: ``kind`` is ``down``, ``down_device``, ``up``, ``secagg_up``, ``secagg_down``,
    ``status``, ``answer``, ``alert`` (then ``rule`` says which), ``roll_call``, ``model_offer`` or ``model_chunk`` (then ``model``, ``version`` and ``index`` say which)."""

    kind: str
    fleet: str
    task: str | None = None
    device: str | None = None
    model: str | None = None
    version: int | None = None
    index: int | None = None
    rule: str | None = None


def _uint(text: str, what: str) -> int:
    if not _UINT.match(text):
        raise WireError(f"{what} {text!r} in a topic must be a decimal integer")
    return int(text)


def parse_topic(topic: str) -> Topic:
    """Parse one of our topics; raises ``WireError`` for anything else."""
    parts = topic.split("/")
    if len(parts) < 4 or "/".join(parts[:2]) != PROTOCOL:
        raise WireError(f"not an {PROTOCOL} topic: {topic!r}")
    fleet, rest = check_id("fleet", parts[2]), parts[3:]
    if rest == ["rollcall"]:
        return Topic("roll_call", fleet)
    if rest[0] == "answer" and len(rest) == 3:
        return Topic("answer", fleet, check_id("task", rest[2]), check_id("device", rest[1]))
    if rest[0] == "alert" and len(rest) == 3:
        return Topic("alert", fleet, device=check_id("device", rest[1]), rule=check_id("alert", rest[2]))
    if rest[0] == "status" and len(rest) == 2:
        return Topic("status", fleet, device=check_id("device", rest[1]))
    if rest[0] == "task" and len(rest) >= 3:
        task = check_id("task", rest[1])
        if rest[2] == "down" and len(rest) == 3:
            return Topic("down", fleet, task)
        if rest[2] == "down" and len(rest) == 4:
            return Topic("down_device", fleet, task, check_id("device", rest[3]))
        if rest[2] == "up" and len(rest) == 4:
            return Topic("up", fleet, task, check_id("device", rest[3]))
        if rest[2] == "secagg" and len(rest) == 5 and rest[3] in ("up", "down"):
            # secure aggregation (ioft_protocol.secagg.transport): one device's stage messages
            return Topic(f"secagg_{rest[3]}", fleet, task, check_id("device", rest[4]))
    if rest[0] == "model" and len(rest) == 3 and rest[2] == "manifest":
        return Topic("model_offer", fleet, model=check_id("model", rest[1]))
    if rest[0] == "model" and len(rest) == 5 and rest[3] == "chunk":
        version = _uint(rest[2], "model version")
        if version < 1:
            raise WireError(f"model version must be >= 1 in {topic!r}")
        return Topic(
            "model_chunk",
            fleet,
            model=check_id("model", rest[1]),
            version=version,
            index=_uint(rest[4], "chunk"),
        )
    raise WireError(f"unknown topic layout: {topic!r}")

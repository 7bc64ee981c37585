"""Topic names under ``ioft/v1/<fleet>/`` and their parser (the layout is in the package docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ioft_protocol.codec import WireError, check_id

PROTOCOL = "ioft/v1"
_UINT = re.compile(r"^(0|[1-9][0-9]{0,8})$")
#: Stand-ins a subscription or an ACL line holds in place of a task or device id: any one level, and
#: (mosquitto's ``pattern`` lines) the logged-in client's own name.
ANY, MINE = "+", "%u"


def _id(what: str, value: str) -> str:
    """``value`` checked as an id of ``what``, or one of the stand-ins :data:`ANY` and :data:`MINE`."""
    return value if value in (ANY, MINE) else check_id(what, value)


def fleet_root(fleet: str) -> str:
    """``ioft/v1/<fleet>``: every topic of the fleet lies under it (``ANY``: of every fleet)."""
    return f"{PROTOCOL}/{_id('fleet', fleet)}"


def topic_down(fleet: str, task: str) -> str:
    return f"{fleet_root(fleet)}/task/{_id('task', task)}/down"


def topic_down_all(fleet: str) -> str:
    """Every task's round announcement (the devices and the aggregator workers follow them all)."""
    return topic_down(fleet, ANY)


def topic_down_device(fleet: str, task: str, device: str) -> str:
    return f"{topic_down(fleet, task)}/{_id('device', device)}"


def topic_up(fleet: str, task: str, device: str) -> str:
    return f"{fleet_root(fleet)}/task/{_id('task', task)}/up/{_id('device', device)}"


def topic_up_all(fleet: str, task: str = ANY) -> str:
    return topic_up(fleet, task, ANY)


def topic_secagg_down(fleet: str, task: str, device: str) -> str:
    """Secure aggregation: one device's SecAgg requests (``ioft_protocol.secagg.transport``)."""
    return f"{fleet_root(fleet)}/task/{_id('task', task)}/secagg/down/{_id('device', device)}"


def topic_secagg_up(fleet: str, task: str, device: str) -> str:
    """Secure aggregation: one device's SecAgg answers."""
    return f"{fleet_root(fleet)}/task/{_id('task', task)}/secagg/up/{_id('device', device)}"


def topic_stats(fleet: str, task: str, device: str) -> str:
    """A device's feature statistics for a task with ``scaling = "fleet"`` (``ioft_protocol.feature_stats``)."""
    return f"{fleet_root(fleet)}/task/{_id('task', task)}/stats/{_id('device', device)}"


def topic_stats_all(fleet: str) -> str:
    return topic_stats(fleet, ANY, ANY)


def topic_scaling(fleet: str, task: str) -> str:
    """The pooled feature scaling of a ``scaling = "fleet"`` task: the aggregator's, retained."""
    return f"{fleet_root(fleet)}/task/{_id('task', task)}/scaling"


def topic_scaling_all(fleet: str) -> str:
    return topic_scaling(fleet, ANY)


def topic_status(fleet: str, device: str) -> str:
    return f"{fleet_root(fleet)}/status/{_id('device', device)}"


def topic_status_all(fleet: str) -> str:
    return topic_status(fleet, ANY)


def topic_answer(fleet: str, device: str, task: str) -> str:
    """A device's answers to its new rows for one task (``edge.serving``): QoS 1, the latest retained."""
    return f"{fleet_root(fleet)}/answer/{_id('device', device)}/{_id('task', task)}"


def topic_answer_all(fleet: str, device: str = ANY) -> str:
    """Every task's answers of ``device`` (default: of every device)."""
    return topic_answer(fleet, device, ANY)


def topic_alert(fleet: str, device: str, rule: str) -> str:
    """One alert rule of a device (``edge.serving.alerts``): a message when it is raised and one
    when it clears, QoS 1, retained (the latest says whether it is open)."""
    return f"{fleet_root(fleet)}/alert/{_id('device', device)}/{_id('alert', rule)}"


def topic_alert_all(fleet: str, device: str = ANY) -> str:
    """Every alert rule of ``device`` (default: of every device)."""
    return topic_alert(fleet, device, ANY)


#: Home Assistant's discovery prefix (its MQTT integration's default): serve republishes there.
DISCOVERY_PREFIX = "homeassistant"


def topic_discovery(fleet: str, device: str, component: str, object_id: str) -> str:
    """A device's Home Assistant discovery config for one entity (``edge.serving.home_assistant``):
    only the device writes it, and the aggregator republishes it, rebuilt, where Home Assistant reads
    (``cloud_aggregator.serve.home_assistant``)."""
    return f"{fleet_root(fleet)}/ha/{_id('device', device)}/{_id('component', component)}/{_id('object', object_id)}"


def topic_discovery_all(fleet: str, device: str = ANY) -> str:
    """Every discovery config of ``device`` (default: of every device)."""
    return f"{fleet_root(fleet)}/ha/{_id('device', device)}/{ANY}/{ANY}"


def topic_roll_call(fleet: str) -> str:
    """The aggregator asks every device to publish its status again (``ioft_protocol.restate``)."""
    return f"{fleet_root(fleet)}/rollcall"


def topic_aggregator_lock(fleet: str) -> str:
    """The retained topic on which the running aggregator of ``fleet`` holds its lock
    (``cloud_aggregator.serve.singleton``)."""
    return f"{fleet_root(fleet)}/aggregator"


def topic_agg(fleet: str) -> str:
    """Under it the aggregator's coordinator and its workers talk (``cloud_aggregator.serve.worker_wire``):
    ``worker/<id>`` (a worker's state), ``batch/<task>/<id>`` (its batches), ``ctl`` (the coordinator's)."""
    return f"{fleet_root(fleet)}/agg"


def topic_agg_worker(fleet: str, worker: str) -> str:
    return f"{topic_agg(fleet)}/worker/{_id('worker', worker)}"


def topic_agg_batch(fleet: str, task: str, worker: str) -> str:
    return f"{topic_agg(fleet)}/batch/{_id('task', task)}/{_id('worker', worker)}"


def topic_agg_ctl(fleet: str) -> str:
    return f"{topic_agg(fleet)}/ctl"


def topic_models(fleet: str) -> str:
    """Every model push of the fleet: offers and chunks (the operator's commands publish them)."""
    return f"{fleet_root(fleet)}/model/#"


def topic_model_offer(fleet: str, name: str) -> str:
    return f"{fleet_root(fleet)}/model/{_id('model', name)}/manifest"


def topic_model_offer_all(fleet: str) -> str:
    return topic_model_offer(fleet, ANY)


def topic_model_chunk(fleet: str, name: str, version: int, index: int) -> str:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise WireError(f"model version must be an int >= 1, got {version!r}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise WireError(f"chunk index must be an int >= 0, got {index!r}")
    return f"{fleet_root(fleet)}/model/{check_id('model', name)}/{version}/chunk/{index}"


def topic_model_chunk_all(fleet: str) -> str:
    """Every chunk of every model version."""
    return f"{fleet_root(fleet)}/model/{ANY}/{ANY}/chunk/{ANY}"


@dataclass(frozen=True)
class Topic:
    """A parsed topic: ``kind`` is ``down``, ``down_device``, ``up``, ``secagg_up``, ``secagg_down``,
    ``status``, ``stats``, ``scaling``, ``answer``, ``alert`` (then ``rule`` says which), ``roll_call``, ``model_offer`` or ``model_chunk`` (then ``model``, ``version`` and ``index`` say which)."""

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
        if rest[2] == "stats" and len(rest) == 4:
            return Topic("stats", fleet, task, check_id("device", rest[3]))
        if rest[2] == "scaling" and len(rest) == 3:
            return Topic("scaling", fleet, task)
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

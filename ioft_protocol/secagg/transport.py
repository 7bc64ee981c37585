"""SecAgg over MQTT: its topics, the envelope each stage message travels in, and the update vector.

Topics, under ``ioft/v1/<fleet>/task/<task>/secagg/``::

    down/<device>   server -> one device (setup, neighbour keys, its inbox of sealed shares,
                    unmask request); the broker ACL lets only that device read it
    up/<device>     device -> server (keys, shares, masked input, unmask answer); only
                    that device may write it

Both sides agree on the vector: the change of the shared parameters from the announced
global, flattened in sorted-name order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ioft_protocol import compress, topics
from ioft_protocol.codec import WireError, check_id
from ioft_protocol.compress import CompressConfig
from ioft_protocol.secagg.config import SecAggConfig
from ioft_protocol.secagg.messages import (
    AdvertiseKeys,
    Inbox,
    MaskedInput,
    Message,
    NeighbourKeys,
    SecAggWireError,
    Setup,
    ShareKeys,
    UnmaskAnswer,
    UnmaskRequest,
)

#: server -> device message classes by stage, and the device's answer to each
REQUESTS: dict[str, type[Message]] = {
    "setup": Setup,
    "neighbour_keys": NeighbourKeys,
    "inbox": Inbox,
    "unmask": UnmaskRequest,
}
ANSWERS: dict[str, type[Message]] = {
    "setup": AdvertiseKeys,
    "neighbour_keys": ShareKeys,
    "inbox": MaskedInput,
    "unmask": UnmaskAnswer,
}


def topic_down(fleet: str, task: str, device: str) -> str:
    return topics.topic_secagg_down(fleet, check_id("task", task), check_id("device", device))


def topic_up(fleet: str, task: str, device: str) -> str:
    return topics.topic_secagg_up(fleet, check_id("task", task), check_id("device", device))


def topic_up_all(fleet: str) -> str:
    return topics.topic_secagg_up(fleet, topics.ANY, topics.ANY)


def topic_down_mine(fleet: str, device: str) -> str:
    return topics.topic_secagg_down(fleet, topics.ANY, check_id("device", device))


def key_scope(fleet: str, task: str, round_: int, phase: str) -> str:
    """What a device's signed keys are for, beyond the session: both ends build it from the topic
    and the envelope, so keys signed for one task's round are refused in another's."""
    return f"{fleet}/{task}/{round_}/{phase}"


@dataclass(frozen=True)
class SecAggTopic:
    direction: str  # "up" or "down"
    fleet: str
    task: str
    device: str


def parse_topic(topic: str) -> SecAggTopic | None:
    """The parts of a SecAgg topic; ``None`` for any other topic."""
    try:
        t = topics.parse_topic(topic)
    except WireError:
        return None
    if t.kind not in ("secagg_up", "secagg_down") or t.task is None or t.device is None:
        return None
    return SecAggTopic(t.kind.removeprefix("secagg_"), t.fleet, t.task, t.device)


@dataclass(frozen=True)
class Envelope(Message):
    """One stage message of one SecAgg session (a task's round and phase)."""

    kind: ClassVar[str] = "secagg"
    session: str
    round: int
    phase: str
    stage: str
    body: bytes

    def open(self, table: Mapping[str, type[Message]]) -> Message:
        if not isinstance(self.body, bytes) or self.stage not in table:
            raise SecAggWireError(f"unknown SecAgg stage {self.stage!r}; valid: {sorted(table)}")
        return table[self.stage].decode(self.body)


def flatten(delta: Mapping[str, np.ndarray]) -> np.ndarray:
    """One float64 vector of the named arrays, in sorted-name order."""
    if not delta:
        return np.zeros(0)
    return np.concatenate([np.asarray(delta[n], dtype=np.float64).ravel() for n in sorted(delta)])


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of :func:`flatten`, shaped and typed like ``like``."""
    out, at = {}, 0
    for n in sorted(like):
        ref = np.asarray(like[n])
        out[n] = np.asarray(vector[at : at + ref.size]).reshape(ref.shape).astype(ref.dtype)
        at += ref.size
    if at != vector.size:
        raise ValueError(f"vector has {vector.size} coordinates, the parameters {at}")
    return out


def change(shared: Mapping[str, np.ndarray], global_params: Mapping[str, np.ndarray]) -> np.ndarray:
    """A device's update vector: its shared parameters less the announced global."""
    if sorted(shared) != sorted(global_params):
        raise ValueError(f"shared names {sorted(shared)} differ from the global's {sorted(global_params)}")
    return flatten(shared) - flatten(global_params)


def secagg_input(
    shared: Mapping[str, np.ndarray],
    global_params: Mapping[str, np.ndarray],
    secagg: Mapping[str, Any],
    how: Mapping[str, Any] | None,
    *,
    task: str,
    round_: int,
    phase: str,
    device: str,
    global_hash: str,
) -> np.ndarray:
    """What a device feeds its SecAgg round (the task's ``secagg`` and ``compress`` tables): its
    change, or with ``how`` that change's integer codes on the round's shared rotation and grid
    (``ioft_protocol.compress.encode_ring``; the grid spans the task's ``secagg.clip``)."""
    x = change(shared, global_params)
    if how is None:
        return x
    cfg, clip = CompressConfig.from_json(dict(how)), SecAggConfig.from_json(dict(secagg)).clip
    rotation = compress.shared_seed(task, round_, phase, global_hash)
    dither = compress.derive_seed(task, round_, phase, device, global_hash)
    return compress.encode_ring(x, cfg, clip, rotation, dither)


def device_weight(server: Mapping[str, object], n_samples: int) -> float:
    """What a device weighs under the task's weighting (``samples`` or ``uniform``), before the cap."""
    weighting = server.get("weighting", "samples")
    if weighting == "uniform":
        return 1.0
    if weighting == "samples":
        return float(n_samples)
    raise ValueError(f"secagg supports weighting 'samples' or 'uniform', not {weighting!r}")

"""Round messages: the retained announcement (downlink) and a device's update (uplink)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ioft_protocol.codec import MAX_PAYLOAD_BYTES, WireError, check_id, decode, encode
from ioft_protocol.codec import require_field as _field


@dataclass(frozen=True)
class Announcement:
    """A round announcement, retained on ``task/<task>/down`` with the global shared parameters.

    ``spec`` is the task spec JSON (algorithm, model, hyperparameters); ``deadline``
    is a Unix time; ``global_hash`` identifies the parameters the round starts from
    (uploads quote it).  ``state`` is ``"running"`` or ``"done"`` (training finished).

    Strategies that personalize the downlink (FTL-TP's group layers, FedPP's propagated
    models) also retain one announcement per device on ``down/<device>``: there
    ``for_device`` names it, ``params`` are its own and ``params_hash`` is their hash.  The broadcast
    lists those devices in ``personalized`` so they wait for their own copy, and the
    server's selection in ``participants`` (``None``: every device that is online).
    """

    fleet: str
    task: str
    round: int
    phase: str
    spec: str
    deadline: float
    global_hash: str
    state: str = "running"
    params: dict[str, np.ndarray] = field(default_factory=dict)
    params_hash: str = ""  # empty: the params are the global ones (hash = global_hash)
    for_device: str | None = None
    personalized: tuple[str, ...] = ()
    participants: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.params_hash:
            object.__setattr__(self, "params_hash", self.global_hash)

    def encode(self) -> bytes:
        fields = {
            k: getattr(self, k)
            for k in ("fleet", "task", "round", "phase", "spec", "deadline", "global_hash", "state")
        }
        fields["params_hash"] = self.params_hash
        fields["for_device"] = self.for_device
        fields["personalized"] = sorted(self.personalized)
        fields["participants"] = None if self.participants is None else sorted(self.participants)
        return encode("round", fields, self.params)

    def takes_part(self, device: str) -> bool:
        """Whether ``device`` is asked to train on this announcement's parameters."""
        if self.participants is not None and device not in self.participants:
            return False
        if self.for_device is not None:
            return self.for_device == device
        # A device with a personal downlink ignores the broadcast and waits for its own.
        return device not in self.personalized

    @classmethod
    def decode(cls, payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Announcement:
        meta, tensors = decode(payload, max_bytes=max_bytes)
        if meta["kind"] != "round":
            raise WireError(f"expected a round announcement, got kind {meta['kind']!r}")
        state = _field(meta, "state", str)
        if state not in ("running", "done"):
            raise WireError(f"round state must be 'running' or 'done', got {state!r}")
        return cls(
            fleet=check_id("fleet", _field(meta, "fleet", str)),
            task=check_id("task", _field(meta, "task", str)),
            round=_field(meta, "round", int),
            phase=_field(meta, "phase", str),
            spec=_field(meta, "spec", str),
            deadline=float(_field(meta, "deadline", (int, float))),
            global_hash=_field(meta, "global_hash", str),
            state=state,
            params=tensors,
            params_hash=_field(meta, "params_hash", str),
            for_device=None
            if meta.get("for_device") is None
            else check_id("device", _field(meta, "for_device", str)),
            personalized=_device_list(meta, "personalized"),
            participants=None if meta.get("participants") is None else _device_list(meta, "participants"),
        )


def _device_list(meta: dict[str, Any], key: str) -> tuple[str, ...]:
    value = _field(meta, key, list)
    if not all(isinstance(d, str) for d in value):
        raise WireError(f"field {key!r} must list device ids")
    return tuple(check_id("device", d) for d in value)


@dataclass(frozen=True)
class UpdateMessage:
    """A device's upload: only the algorithm's shared parameters, a sample count and scalar metrics."""

    fleet: str
    task: str
    device: str
    round: int
    phase: str
    n_samples: int
    global_hash: str
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, np.ndarray] = field(default_factory=dict)

    def encode(self) -> bytes:
        fields = {
            k: getattr(self, k)
            for k in ("fleet", "task", "device", "round", "phase", "n_samples", "global_hash")
        }
        fields["metrics"] = {k: float(v) for k, v in self.metrics.items()}
        return encode("update", fields, self.params)

    @classmethod
    def decode(cls, payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> UpdateMessage:
        meta, tensors = decode(payload, max_bytes=max_bytes)
        if meta["kind"] != "update":
            raise WireError(f"expected an update, got kind {meta['kind']!r}")
        metrics = _field(meta, "metrics", dict)
        if not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in metrics.items()
        ):
            raise WireError("metrics must map names to numbers")
        n_samples = _field(meta, "n_samples", int)
        if n_samples < 0:
            raise WireError(f"n_samples must be >= 0, got {n_samples}")
        return cls(
            fleet=check_id("fleet", _field(meta, "fleet", str)),
            task=check_id("task", _field(meta, "task", str)),
            device=check_id("device", _field(meta, "device", str)),
            round=_field(meta, "round", int),
            phase=_field(meta, "phase", str),
            n_samples=n_samples,
            global_hash=_field(meta, "global_hash", str),
            metrics={k: float(v) for k, v in metrics.items()},
            params=tensors,
        )

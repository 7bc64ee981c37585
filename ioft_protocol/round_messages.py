"""Round messages: the retained announcement (downlink) and a device's update (uplink)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ioft_protocol.codec import MAX_PAYLOAD_BYTES, WireError, check_id, decode, encode
from ioft_protocol.codec import require_field as _field
from ioft_protocol.compress import CompressError
from ioft_protocol.downlink import decode_global

#: How a task's rounds run: synchronous rounds, or FedBuff's buffered asynchronous ones.
ROUND_MODES = ("sync", "buffered")
#: What a device may declare as its ``kind`` (``device.toml``) and a task may select.
MACHINE_KINDS = ("printer", "welder")


@dataclass(frozen=True)
class DeviceSelection:
    """Which devices a task runs on: ``[[task]] devices = { kind, tags, ids }``.

    Every given criterion must hold: ``kind`` equal to the device's declared kind,
    every one of ``tags`` among the device's tags, and, when ``ids`` is not empty, the
    device among them.  The aggregator waits only for devices it selects (judged from
    their retained status), and the announcement carries the selection so that a
    device outside it refuses the task at once (:meth:`refusal`, one rule both sides run).

    Parameters
    ----------
    kind
        One of :data:`MACHINE_KINDS`, or ``None`` for any kind.
    tags
        Tags a device must all carry (``tags = [...]`` in its ``device.toml``).
    ids
        Device ids the task is limited to (empty: no limit).
    """

    kind: str | None = None
    tags: tuple[str, ...] = ()
    ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in MACHINE_KINDS:
            raise ValueError(f"devices.kind must be one of {list(MACHINE_KINDS)}, got {self.kind!r}")
        for what, values in (("tags", self.tags), ("ids", self.ids)):
            for v in values:
                check_id(f"devices.{what} entry", v)  # a WireError is a ValueError
        object.__setattr__(self, "tags", tuple(self.tags))
        object.__setattr__(self, "ids", tuple(self.ids))

    def refusal(self, device: str, kind: str | None, tags: Sequence[str]) -> str | None:
        """Why ``device`` (of ``kind``, carrying ``tags``) is not selected; ``None`` if it is."""
        if self.ids and device not in self.ids:
            return f"task runs on devices {sorted(self.ids)} only"
        if self.kind is not None and kind != self.kind:
            declared = f"kind {kind!r}" if kind else "no kind"
            return f"task runs on kind {self.kind!r}; this device declares {declared}"
        missing = sorted(set(self.tags) - set(tags))
        if missing:
            return f"task runs on devices tagged {sorted(self.tags)}; this device lacks {missing}"
        return None

    def disjoint(self, other: DeviceSelection | None) -> bool:
        """Whether no device can be selected by both (``None``: every device).

        Judged from the selections alone (devices come and go): two different kinds, or two
        id lists with no id in common.  Tags never make two selections disjoint, since a
        device may carry any tags.
        """
        if other is None:
            return False
        if self.kind is not None and other.kind is not None and self.kind != other.kind:
            return True
        return bool(self.ids) and bool(other.ids) and not set(self.ids) & set(other.ids)

    def to_json(self) -> dict[str, Any]:
        """The selection as a JSON object (announcement field ``devices``)."""
        return {"kind": self.kind, "tags": sorted(self.tags), "ids": sorted(self.ids)}

    @classmethod
    def from_json(cls, value: Any) -> DeviceSelection:
        """Parse :meth:`to_json`'s output; ``WireError`` when it is not one."""
        if not isinstance(value, dict):
            raise WireError(f"field 'devices' must be an object, got {type(value).__name__}")
        kind, tags, ids = value.get("kind"), value.get("tags", []), value.get("ids", [])
        if (
            not (kind is None or isinstance(kind, str))
            or not isinstance(tags, list)
            or not isinstance(ids, list)
        ):
            raise WireError("field 'devices' must hold kind (string or null), tags and ids (lists)")
        try:
            return cls(kind, tuple(tags), tuple(ids))
        except ValueError as exc:
            raise WireError(str(exc)) from None


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
    ``devices`` is the task's :class:`DeviceSelection` (``None``: every device; the
    field is then left out of the message).  ``holdout`` lists held-out devices: they
    never train or upload, only score the global model and report it in their status
    (:class:`HoldoutScore`); the field is left out when empty.  ``mode`` is ``"sync"`` (a
    round: answer once, by the deadline) or ``"buffered"`` (FedBuff: ``round - 1`` is the
    global's version; a device trains from the newest one continuously, quoting a round of
    its own at least ``round``, see ``edge.buffered``); left out when ``"sync"``.
    ``max_samples`` is the most samples one upload counts in this round (the task's weight cap,
    ``cloud_aggregator.aggregation.weighting``), for the aggregator workers that fold uploads;
    devices need not read it; left out when ``None`` (no cap known before the round).
    ``downlink`` (``[task.compress] downlink``) is the codec field of a global sent as codes: the
    sender's ``params`` are those codes, and :meth:`decode` returns the global they decode to
    (:func:`ioft_protocol.downlink.decode_global`); left out when ``None`` (float32).
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
    devices: DeviceSelection | None = None
    holdout: tuple[str, ...] = ()
    mode: str = "sync"
    max_samples: int | None = None
    downlink: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ROUND_MODES:
            raise ValueError(f"round mode must be one of {list(ROUND_MODES)}, got {self.mode!r}")
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
        if self.devices is not None:
            fields["devices"] = self.devices.to_json()
        if self.holdout:
            fields["holdout"] = sorted(self.holdout)
        if self.mode != "sync":
            fields["mode"] = self.mode
        if self.max_samples is not None:
            fields["max_samples"] = self.max_samples
        if self.downlink is not None:
            fields["downlink"] = self.downlink
        return encode("round", fields, self.params)

    def takes_part(self, device: str) -> bool:
        """Whether ``device`` is asked to train on this announcement's parameters."""
        if device in self.holdout:
            return False
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
        mode = _field(meta, "mode", str) if "mode" in meta else "sync"
        if mode not in ROUND_MODES:
            raise WireError(f"round mode must be one of {list(ROUND_MODES)}, got {mode!r}")
        down = meta.get("downlink")
        if down is not None:  # codes of the global: decoded here, once, for every reader
            if not isinstance(down, dict):
                raise WireError(f"downlink must be a table, got {down!r}")
            try:
                tensors = decode_global(tensors, down)
            except CompressError as exc:
                raise WireError(str(exc)) from None
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
            devices=None if meta.get("devices") is None else DeviceSelection.from_json(meta["devices"]),
            holdout=_device_list(meta, "holdout") if "holdout" in meta else (),
            mode=mode,
            max_samples=_field(meta, "max_samples", int) if meta.get("max_samples") is not None else None,
            downlink=down,
        )


@dataclass(frozen=True)
class HoldoutScore:
    """A held-out device's score of a round's global model, kept in its retained status
    (``holdout: {task: score}``): it trained on nothing, so the score tests the fleet's model
    on a machine it has never seen (the IoFT talk's held-out-device testing)."""

    round: int
    phase: str
    global_hash: str
    metrics: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "phase": self.phase,
            "global_hash": self.global_hash,
            "metrics": self.metrics,
        }

    @classmethod
    def from_json(cls, value: Any) -> HoldoutScore | None:
        """The score in a status, or ``None`` when it is not one (a status is never trusted)."""
        if not isinstance(value, dict):
            return None
        round_, phase, gh, metrics = (value.get(k) for k in ("round", "phase", "global_hash", "metrics"))
        if not (isinstance(round_, int) and isinstance(phase, str) and isinstance(gh, str)):
            return None
        if not isinstance(metrics, dict):
            return None
        kept = {k: float(v) for k, v in metrics.items() if isinstance(k, str) and isinstance(v, int | float)}
        return cls(round_, phase, gh, kept)


def _device_list(meta: dict[str, Any], key: str) -> tuple[str, ...]:
    value = _field(meta, key, list)
    if not all(isinstance(d, str) for d in value):
        raise WireError(f"field {key!r} must list device ids")
    return tuple(check_id("device", d) for d in value)


@dataclass(frozen=True)
class UpdateMessage:
    """A device's upload: only the algorithm's shared parameters, a sample count and scalar metrics.

    ``compress`` (``ioft_protocol.compress.CompressConfig.to_json()``) marks a compressed upload:
    ``params`` then holds the codes of the change from the downlink, which admission decodes
    against what it sent the device; ``None`` (left out of the message): the parameters as they are.
    """

    fleet: str
    task: str
    device: str
    round: int
    phase: str
    n_samples: int
    global_hash: str
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    compress: dict[str, Any] | None = None

    def encode(self) -> bytes:
        fields = {
            k: getattr(self, k)
            for k in ("fleet", "task", "device", "round", "phase", "n_samples", "global_hash")
        }
        fields["metrics"] = {k: float(v) for k, v in self.metrics.items()}
        if self.compress is not None:
            fields["compress"] = self.compress
        return encode("update", fields, self.params)

    @classmethod
    def decode(cls, payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> UpdateMessage:
        meta, tensors = decode(payload, max_bytes=max_bytes)
        if meta["kind"] != "update":
            raise WireError(f"expected an update, got kind {meta['kind']!r}")
        fast = cls._plain(meta, tensors)
        if fast is not None:
            return fast
        metrics = _field(meta, "metrics", dict)
        if not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in metrics.items()
        ):
            raise WireError("metrics must map names to numbers")
        try:
            metrics = {k: float(v) for k, v in metrics.items()}
        except OverflowError:  # an integer beyond float's range
            raise WireError("a metric is too large for a float") from None
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
            metrics=metrics,
            params=tensors,
            compress=None if meta.get("compress") is None else _field(meta, "compress", dict),
        )

    @classmethod
    def _plain(cls, meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> UpdateMessage | None:
        """The message of ``meta`` whose every field is of its type (JSON gives exact types) and whose
        metrics are floats, in one look; ``None`` for anything else, which :meth:`decode` judges
        field by field, in its order and words."""
        get = meta.get
        fleet, task, device, round_, phase, n_samples, global_hash, metrics, compress = (
            get("fleet"),
            get("task"),
            get("device"),
            get("round"),
            get("phase"),
            get("n_samples"),
            get("global_hash"),
            get("metrics"),
            get("compress"),
        )
        if not (
            type(fleet) is type(task) is type(device) is type(phase) is type(global_hash) is str
            and type(round_) is type(n_samples) is int
            and n_samples >= 0
            and type(metrics) is dict
            and (compress is None or type(compress) is dict)
            and all(type(v) is float for v in metrics.values())  # names: JSON object keys are str
        ):
            return None
        check_id("fleet", fleet), check_id("task", task), check_id("device", device)
        # The frozen dataclass's __init__ sets each field through object.__setattr__ (a call a field):
        # its instance dict filled at once is the same object.
        msg = object.__new__(cls)
        msg.__dict__.update(
            fleet=fleet,
            task=task,
            device=device,
            round=round_,
            phase=phase,
            n_samples=n_samples,
            global_hash=global_hash,
            metrics=metrics,
            params=tensors,
            compress=compress,
        )
        return msg

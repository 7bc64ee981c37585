"""The stage messages and their wire form.

Wire: ``b"SA1"``, a 4-byte big-endian header length, a compact JSON header, then the raw
bytes fields one after another (the header names each by ``{"$b": [offset, length]}``),
so keys, shares and the masked vector travel without base64.
"""

from __future__ import annotations

import json
import struct
import typing
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ioft_protocol.secagg.config import RoundParams

_MAGIC = b"SA1"
MAX_BYTES = 256 * 1024 * 1024


class SecAggWireError(ValueError):
    """A SecAgg payload that does not parse or has the wrong fields; it is dropped."""


def _flatten(value: Any, blobs: list[bytes], offset: list[int]) -> Any:
    if isinstance(value, bytes):
        blobs.append(value)
        ref = {"$b": [offset[0], len(value)]}
        offset[0] += len(value)
        return ref
    if isinstance(value, dict):
        return {k: _flatten(v, blobs, offset) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_flatten(v, blobs, offset) for v in value]
    return value


def _restore(value: Any, body: bytes) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$b"}:
            ref = value["$b"]
            if not (isinstance(ref, list) and len(ref) == 2):
                raise SecAggWireError("a bytes field must be [offset, length]")
            start, length = ref
            if not (
                isinstance(start, int)
                and isinstance(length, int)
                and 0 <= start <= start + length <= len(body)
            ):
                raise SecAggWireError("a bytes field points outside the payload")
            return body[start : start + length]
        return {k: _restore(v, body) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v, body) for v in value]
    return value


def pack(kind: str, payload: dict[str, Any]) -> bytes:
    blobs: list[bytes] = []
    header = json.dumps({"kind": kind, **_flatten(payload, blobs, [0])}, separators=(",", ":")).encode()
    return _MAGIC + struct.pack(">I", len(header)) + header + b"".join(blobs)


def unpack(data: bytes, *, max_bytes: int = MAX_BYTES) -> tuple[str, dict[str, Any]]:
    if len(data) > max_bytes:
        raise SecAggWireError(f"payload of {len(data)} bytes exceeds {max_bytes}")
    if data[:3] != _MAGIC or len(data) < 7:
        raise SecAggWireError("not a SecAgg payload (bad magic)")
    (n,) = struct.unpack(">I", data[3:7])
    try:
        header = json.loads(data[7 : 7 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SecAggWireError(f"bad SecAgg header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise SecAggWireError("SecAgg header has no kind")
    kind = header.pop("kind")
    return kind, _restore(header, data[7 + n :])


class Message:
    """Base: a dataclass with a ``kind``; ``encode``/``decode`` go through :func:`pack`."""

    kind: ClassVar[str]

    def encode(self) -> bytes:
        return pack(self.kind, {f.name: getattr(self, f.name) for f in fields(self)})  # type: ignore[arg-type]

    @classmethod
    def decode(cls, data: bytes) -> Any:
        kind, payload = unpack(data)
        if kind != cls.kind:
            raise SecAggWireError(f"expected a {cls.kind!r} message, got {kind!r}")
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if set(payload) != names:
            raise SecAggWireError(
                f"{cls.kind} message has fields {sorted(payload)}, expected {sorted(names)}"
            )
        hints = typing.get_type_hints(cls)
        for name, value in payload.items():
            if not _conforms(value, hints[name]):
                raise SecAggWireError(f"{cls.kind} message: field {name!r} is not {hints[name]}")
        return cls(**payload)


def _conforms(value: Any, tp: Any) -> bool:
    """Whether a decoded JSON value matches a field's annotation (the few shapes used here)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(v, args[1]) for v in value.values())
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


@dataclass(frozen=True)
class Setup(Message):
    """Server → device: the round's parameters and the device's neighbours."""

    kind: ClassVar[str] = "setup"
    session: str
    params: dict[str, Any]
    neighbours: list[str]

    @property
    def round_params(self) -> RoundParams:
        return RoundParams.from_json(self.params)


@dataclass(frozen=True)
class AdvertiseKeys(Message):
    """Device → server: its share-encryption and mask-agreement public keys.

    ``cert`` (DER) and ``signature`` bind them to the device's enrolled identity
    (``ioft_protocol.secagg.identity``); both empty when the device has no certificate.
    """

    kind: ClassVar[str] = "keys"
    c_pk: bytes
    s_pk: bytes
    cert: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class NeighbourKeys(Message):
    """Server → device: the public keys of its neighbours that advertised."""

    kind: ClassVar[str] = "neighbour_keys"
    keys: dict[str, list[bytes]]  # neighbour -> [c_pk, s_pk], or [c_pk, s_pk, cert, signature] if signed


@dataclass(frozen=True)
class ShareKeys(Message):
    """Device → server: one sealed share pair per neighbour (the server cannot open them)."""

    kind: ClassVar[str] = "shares"
    sealed: dict[str, bytes]  # recipient -> ciphertext


@dataclass(frozen=True)
class Inbox(Message):
    """Server → device: the sealed shares addressed to it."""

    kind: ClassVar[str] = "inbox"
    sealed: dict[str, bytes]  # sender -> ciphertext


@dataclass(frozen=True)
class MaskedInput(Message):
    """Device → server: its masked ring vector, ``ring_bits`` bits per coordinate (``quantize.pack``)."""

    kind: ClassVar[str] = "masked"
    ring_bits: int
    y: bytes


@dataclass(frozen=True)
class UnmaskRequest(Message):
    """Server → device: which of its neighbours survived and which dropped after sharing keys."""

    kind: ClassVar[str] = "unmask"
    survivors: list[str]
    dropped: list[str]


@dataclass(frozen=True)
class UnmaskAnswer(Message):
    """Device → server: self-mask shares of survivors, mask-key shares of the dropped."""

    kind: ClassVar[str] = "unmask_answer"
    b_shares: dict[str, bytes]
    s_shares: dict[str, bytes]

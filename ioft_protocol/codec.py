"""Payload encoding (safetensors bytes with one JSON metadata key), ids and tensor checks."""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from json.decoder import scanstring as _scanstring
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

VERSION = 1
#: Default ceiling on a payload; mosquitto's own default limit is 256 MB.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_FLOATS = ("float32", "float64")
#: What a tensor on the wire may be: floats, and the bytes of a compressed upload's codes
#: (``ioft_protocol.compress``); ``validate_tensors`` still holds each to the round's dtype.
_WIRE_DTYPES = (*_FLOATS, "uint8")
#: The same as dtype objects: ``dtype.name`` is computed in Python on each read (~1.7 µs), a
#: comparison of dtypes is not.
_WIRE = frozenset(np.dtype(n) for n in _WIRE_DTYPES)


#: safetensors' dtype codes in the order of its ``Dtype`` enum: its writer lays tensors out by
#: dtype, highest first, then by name (:func:`safetensors_bytes` must lay them out the same).
_ST_DTYPES = {
    np.dtype(name): (rank, code)
    for rank, (name, code) in enumerate(
        (
            ("bool", "BOOL"),
            ("uint8", "U8"),
            ("int8", "I8"),
            ("int16", "I16"),
            ("uint16", "U16"),
            ("float16", "F16"),
            ("int32", "I32"),
            ("uint32", "U32"),
            ("float32", "F32"),
            ("float64", "F64"),
            ("int64", "I64"),
            ("uint64", "U64"),
        )
    )
}


def safetensors_bytes(arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """``safetensors.numpy.save(arrays, metadata)`` byte for byte, without its per-call Python.

    A swarm encodes two of these per device-round (its upload message and its task state):
    safetensors' own wrapper spends ~10 µs on a 4 kB message.  The format: 8 bytes of header
    length, the JSON header (``__metadata__`` first, then each tensor's dtype, shape and data
    offsets in layout order) padded with spaces to a multiple of 8, then the tensors' bytes.
    Arrays of another dtype or byte order, or not C-contiguous, and metadata that is not all
    strings, go to safetensors itself.  (Its metadata is a hash map: with several keys their order
    in its header varies from run to run; here they keep the order given.)
    """
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        return st_save(arrays, metadata=metadata)
    try:
        signature = tuple([(name, type(arr), arr.dtype, arr.shape) for name, arr in arrays.items()])
    except AttributeError:  # not an array
        return st_save(arrays, metadata=metadata)
    layout = _LAYOUTS.get(signature)
    if layout is None:
        layout = _lay_out(arrays)
        if layout is None:
            return st_save(arrays, metadata=metadata)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[signature] = layout
    order, tensors = layout
    laid = [arrays[name] for name in order]
    if not all(arr.flags.c_contiguous for arr in laid):
        return st_save(arrays, metadata=metadata)
    # Only the metadata changes from one message (or state file) to the next: the tensors' part
    # of the header is made once per layout.
    if metadata is None:
        text = ("{" + tensors + "}").encode()
    else:
        text = ('{"__metadata__":' + _json(metadata) + ("," + tensors if tensors else "") + "}").encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *laid])


#: arrays' (name, type, dtype, shape) in the caller's order -> (names in layout order, the tensors' header text)
_LAYOUTS: dict[tuple, tuple[tuple[str, ...], str]] = {}
_LAYOUTS_MAX = 1024


def _lay_out(arrays: dict[str, np.ndarray]) -> tuple[tuple[str, ...], str] | None:
    """The names in safetensors' layout order and the header text of the tensors (``None``: a dtype
    :func:`safetensors_bytes` leaves to safetensors)."""
    laid = []
    for name, arr in arrays.items():
        kind = _ST_DTYPES.get(arr.dtype) if isinstance(arr, np.ndarray) else None
        if kind is None:
            return None
        laid.append((-kind[0], name, kind[1], arr))
    laid.sort(key=_layout)
    # The header written piece by piece: one json.dumps of a nested dict costs more than the rest.
    parts = []
    offset = 0
    for _, name, code, arr in laid:
        end = offset + arr.nbytes
        shape = ",".join(map(str, arr.shape))
        quoted = f'"{name}"' if _PLAIN(name) else _json(name)
        parts.append(f'{quoted}:{{"dtype":"{code}","shape":[{shape}],"data_offsets":[{offset},{end}]}}')
        offset = end
    return tuple(name for _, name, _, _ in laid), ",".join(parts)


def _layout(t: tuple) -> tuple:
    return t[0], t[1]


#: JSON text as safetensors (serde_json) writes it: compact, non-ASCII as is.
_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
#: A tensor name JSON writes as it is, between quotes (most are: ``layer.weight``).
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]*\Z").match


class WireError(ValueError):
    """A payload or topic that does not follow the protocol; the message is dropped."""


class TensorMismatchError(WireError):
    """Tensor names, shapes or dtypes differ from what the round expects."""


class NonFiniteTensorError(WireError):
    """A tensor holds NaN or Inf."""


def check_id(kind: str, value: str) -> str:
    """Fleet, task and device ids are topic-safe: ``[a-z0-9][a-z0-9_-]{0,62}``."""
    if type(value) is str and value in _GOOD_IDS:  # every upload names its fleet, task and device
        return value
    if not isinstance(value, str) or not _ID.match(value):
        raise WireError(f"{kind} id {value!r} must match [a-z0-9][a-z0-9_-]{{0,62}}")
    if len(_GOOD_IDS) < _GOOD_IDS_MAX:  # bounded: a stream of made-up ids cannot grow it
        _GOOD_IDS.add(value)
    return value


#: Ids :func:`check_id` has passed (a set look-up, not the pattern's match, on the next message).
_GOOD_IDS: set[str] = set()
_GOOD_IDS_MAX = 1 << 17


@dataclass(frozen=True)
class TensorSpec:
    """What one uploaded tensor must look like."""

    shape: tuple[int, ...]
    dtype: str


def encode(kind: str, fields: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> bytes:
    """Serialize a message: ``fields`` must be JSON-able; tensors float arrays (or uint8 codes)."""
    meta = {"v": VERSION, "kind": kind, **fields}
    arrays = {}
    for name, value in (tensors or {}).items():
        arr = np.ascontiguousarray(value)
        if arr.dtype not in _WIRE and arr.dtype.name not in _WIRE_DTYPES:
            raise WireError(f"tensor {name!r} has dtype {arr.dtype}; the wire carries {_WIRE_DTYPES}")
        arrays[name] = arr
    return safetensors_bytes(arrays, {"ioft": _fields_json(meta)})


#: ``json.dumps(meta, separators=(",", ":"), sort_keys=True)`` with its encoder made once (``dumps``
#: builds one per call when given options: a swarm's devices encode an upload each per round).
_fields_json = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def decode(
    payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse a payload into ``(fields, tensors)``: size, then format, then version.

    Raises
    ------
    WireError
        With a message saying what was wrong; the caller logs it and drops the message.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise WireError(f"payload must be bytes, got {type(payload).__name__}")
    size = len(payload)
    if size > max_bytes:
        raise WireError(f"payload of {size} bytes exceeds the limit of {max_bytes}")
    if size < 8:
        raise WireError(f"payload of {size} bytes is too short to be a message")
    payload = bytes(payload)
    try:
        tensors = st_load(payload)
        (header_len,) = struct.unpack("<Q", payload[:8])
        text = _ioft_text(payload[8 : 8 + header_len])
        if text is None:
            text = json.loads(payload[8 : 8 + header_len])["__metadata__"]["ioft"]
        meta = json.loads(text)
    except (SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise WireError(f"malformed payload: {exc}") from None
    if not isinstance(meta, dict) or meta.get("v") != VERSION or not isinstance(meta.get("kind"), str):
        raise WireError(f"unsupported message header {str(meta)[:200]!r}; expected version {VERSION}")
    for name, arr in tensors.items():
        if arr.dtype not in _WIRE and arr.dtype.name not in _WIRE_DTYPES:  # e.g. a big-endian float32
            raise WireError(f"tensor {name!r} has dtype {arr.dtype}; the wire carries {_WIRE_DTYPES}")
    return meta, tensors


#: How :func:`encode`'s header starts: its metadata, holding ``ioft`` alone, first.
_IOFT_FIRST = b'{"__metadata__":{"ioft":"'


def _ioft_text(header: bytes) -> str | None:
    """``json.loads(header)["__metadata__"]["ioft"]`` of a header safetensors has read, without
    parsing the whole header a second time (a third of a 4 kB upload's decode); ``None`` where the
    header is not laid out as :func:`encode` writes it (the caller then parses it).

    The ``ioft`` string is read by the JSON reader's own string scanner; it stands for the whole
    parse where the metadata holds it alone (``}`` right after it) and no other key can be
    ``__metadata__`` (said once, and no ``\\u`` escape that could spell it).
    """
    if not header.startswith(_IOFT_FIRST) or header.count(b'"__metadata__"') != 1 or b"\\u" in header:
        return None
    text = header.decode()  # UTF-8: safetensors has checked
    try:
        value, end = _scanstring(text, len(_IOFT_FIRST))
    except ValueError:
        return None
    return value if text[end : end + 1] == "}" else None


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> np.dtype | None:
    """``np.dtype(name)``, once per name; ``None`` for a name NumPy does not know (matches nothing)."""
    try:
        return np.dtype(name)
    except TypeError:
        return None


def validate_tensors(tensors: Mapping[str, np.ndarray], expected: Mapping[str, TensorSpec]) -> None:
    """Names, shapes and dtypes of all tensors, then their finiteness, against what the round expects.

    Raises
    ------
    TensorMismatchError
        Naming the missing or unexpected tensor, or the one of the wrong shape or dtype.
    NonFiniteTensorError
        Naming the tensor that holds NaN or Inf.
    """
    check_layout(tensors, expected)
    check_finite(tensors)


def check_layout(tensors: Mapping[str, np.ndarray], expected: Mapping[str, TensorSpec]) -> None:
    """The names, shapes and dtypes of :func:`validate_tensors`; raises ``TensorMismatchError``."""
    if tensors.keys() != expected.keys():
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        raise TensorMismatchError(
            f"tensor names differ from the round's: missing {missing}, unexpected {extra}"
        )
    for name, spec in expected.items():
        arr = tensors[name]
        if arr.shape != tuple(spec.shape) or (
            arr.dtype != _dtype(spec.dtype) and arr.dtype.name != spec.dtype
        ):
            raise TensorMismatchError(
                f"tensor {name!r} is {arr.dtype.name}{list(arr.shape)}, expected {spec.dtype}{list(spec.shape)}"
            )


def check_finite(tensors: Mapping[str, np.ndarray]) -> None:
    """The finiteness of :func:`validate_tensors`; raises ``NonFiniteTensorError`` naming the first
    tensor (in ``tensors``' order) that holds NaN or Inf."""
    for name, arr in tensors.items():
        if not np.isfinite(arr).all():
            raise NonFiniteTensorError(f"tensor {name!r} holds NaN or Inf")


def require_field(meta: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = meta.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise WireError(f"field {key!r} missing or of wrong type (got {value!r})")
    return value

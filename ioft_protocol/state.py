"""A device's state directory: every write atomic, every read verified.

Writes go to a temp file in the same folder, are fsync'ed, then renamed over the
target (and the folder fsync'ed), so a process killed mid-write leaves either the
old file or the new one, never a torn one.  The previous good copy is kept as
``<name>.prev``; a file that fails verification on load is set aside as
``<name>.corrupt`` and the previous copy is used instead.

Parameter files are safetensors whose metadata holds the caller's JSON ``meta`` and
two checksums: ``sha256`` over the tensors (names, dtypes, shapes, bytes) and
``sha256_meta`` over that digest and the exact ``meta`` text, so silent corruption of
either the tensors or the metadata (a round number, a sample count, the task spec) is
caught.  Files written before ``sha256_meta`` existed still load (their tensors are
verified, their metadata cannot be; a warning says so) and get the full checksum on
their next save.  A caller that needs more than a checksum (required keys, types)
passes ``parse`` to :func:`load_verified`: a copy it refuses counts as corrupt, so the
previous good copy is used.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load

from ioft_protocol.codec import safetensors_bytes
from trainer_lite.params import param_hash

log = logging.getLogger(__name__)
T = TypeVar("T")
_warned_legacy = False


class StateError(RuntimeError):
    """State on disk is unusable and no good copy is left."""


def fsync_dir(folder: Path) -> None:
    """fsync a folder, so that a rename or unlink in it is durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, *, keep_previous: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync folder).

    The temp file is named after the process and thread (``.<name>.<pid>-<thread>.tmp``): one
    writer per thread at a time, so no random name is drawn and no two writers share one.  Plain
    ``os`` calls: a swarm of virtual devices writes thousands of these per round.
    """
    target = os.fspath(path)
    folder, tmp = write_temp(target, data, sync=True)
    try:
        put_in_place(tmp, target, keep_previous=keep_previous)
        fsync_dir(folder)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_temp(target: str, data: bytes, *, sync: bool) -> tuple[str, str]:
    """``data`` in ``target``'s temp file (fsync'ed if ``sync``): the folder and the temp file's path.

    The first half of :func:`atomic_write_bytes`; a caller that passes ``sync=False`` must make the
    file durable itself before :func:`put_in_place` (``edge.group_commit``: one ``syncfs`` for many).
    """
    folder, tmp = _temp_name(target, os.getpid(), threading.get_ident())
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return folder, tmp


def put_in_place(tmp: str, target: str, *, keep_previous: bool) -> None:
    """Rename the (durable) temp file over ``target``, the old one first to ``<target>.prev`` if
    ``keep_previous``; the renames are durable once the folder is synced."""
    if keep_previous:
        with contextlib.suppress(FileNotFoundError):
            os.replace(target, target + ".prev")
    os.replace(tmp, target)


@functools.lru_cache(maxsize=65536)
def _temp_name(target: str, pid: int, thread: int) -> tuple[str, str]:
    """``target``'s folder and its temp file's path for this process and thread (made once: a
    swarm's devices each write their task state every round)."""
    folder, name = os.path.split(target)
    folder = folder or "."
    return folder, os.path.join(folder, f".{name}.{pid}-{thread}.tmp")


def atomic_write_json(path: str | Path, obj: Any, *, keep_previous: bool = False) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), keep_previous=keep_previous)


def _meta_checksum(tensor_hash: str, meta_text: str) -> str:
    """sha256 binding the metadata text to the tensors' digest (format 2)."""
    return hashlib.sha256(b"ioft-state-v2\0" + tensor_hash.encode() + b"\0" + meta_text.encode()).hexdigest()


#: ``json.dumps(meta, sort_keys=True)`` with its encoder made once (``dumps`` builds one per call
#: when given options: a swarm's devices each write a state file per round).
_meta_json = json.JSONEncoder(sort_keys=True).encode


def encode_arrays(arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> bytes:
    """safetensors bytes with ``meta`` and checksums of the arrays and of ``meta`` in the metadata."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    meta_text = _meta_json(meta or {})
    digest = param_hash(arrays)
    header = {"meta": meta_text, "sha256": digest, "sha256_meta": _meta_checksum(digest, meta_text)}
    return safetensors_bytes(arrays, header)


def decode_arrays(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Inverse of ``encode_arrays``; raises ``ValueError`` if a checksum does not match.

    ``meta`` must be a JSON object.  A file without ``sha256_meta`` (written before the
    metadata was checksummed) is accepted on its tensor checksum alone, with a warning.
    """
    try:
        arrays = st_load(data)
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])["__metadata__"]
        meta_text = header["meta"]
        expected = header["sha256"]
        expected_meta = header.get("sha256_meta")
        meta = json.loads(meta_text)
    except (
        SafetensorError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        RecursionError,
        struct.error,
    ) as exc:
        raise ValueError(f"unreadable array file: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"array file metadata is not an object: {type(meta).__name__}")
    digest = param_hash(arrays)
    if digest != expected:
        raise ValueError("array file checksum mismatch")
    if expected_meta is None:
        global _warned_legacy
        if not _warned_legacy:  # once per process: a resumed aggregator reads many old artifacts
            log.warning("array file without a metadata checksum (older format): its metadata is not verified")
            _warned_legacy = True
    elif expected_meta != _meta_checksum(digest, meta_text):
        raise ValueError("array file metadata checksum mismatch")
    return arrays, meta


def save_arrays(
    path: str | Path,
    arrays: dict[str, np.ndarray],
    meta: dict[str, Any] | None = None,
    write: Callable[[str | Path, bytes], None] | None = None,
) -> None:
    """Atomically write arrays + meta, keeping the previous good copy as ``.prev``.

    ``write(path, data)``, if given, puts the bytes in place instead, with the same guarantees
    (``edge.group_commit``: many devices' files made durable together).
    """
    data = encode_arrays(arrays, meta)
    if write is None:
        atomic_write_bytes(path, data, keep_previous=True)
    else:
        write(path, data)


def load_arrays(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """Load verified arrays, falling back to ``.prev``; ``None`` if neither exists.

    Raises
    ------
    StateError
        When files exist but none verifies.
    """
    return load_verified(path, lambda arrays, meta: (arrays, meta))


def load_verified(path: str | Path, parse: Callable[[dict[str, np.ndarray], dict[str, Any]], T]) -> T | None:
    """``parse(arrays, meta)`` of the first copy that verifies and parses, trying ``path`` then ``.prev``.

    ``parse`` refuses a copy by raising ``ValueError``, ``KeyError`` or ``TypeError`` (a
    missing or ill-typed metadata key); that copy is then set aside as ``*.corrupt``
    like one whose checksum fails.  ``None`` if neither copy exists.

    Raises
    ------
    StateError
        When files exist but none verifies and parses.
    """
    path = Path(path)
    candidates = [path, path.with_name(path.name + ".prev")]
    if not any(p.exists() for p in candidates):
        return None
    for candidate in candidates:
        if not candidate.exists():
            continue
        try:
            arrays, meta = decode_arrays(candidate.read_bytes())
            return parse(arrays, meta)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("state file %s is corrupt (%s); trying the previous copy", candidate, exc)
            os.replace(candidate, candidate.with_name(candidate.name + ".corrupt"))
    raise StateError(f"no good copy of {path} (corrupt copies set aside as *.corrupt)")

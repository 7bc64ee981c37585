"""A device's state directory: every write atomic, every read verified.

Writes go to a temp file in the same folder, are fsync'ed, then renamed over the
target (and the folder fsync'ed), so a process killed mid-write leaves either the
old file or the new one, never a torn one.  The previous good copy is kept as
``<name>.prev``; a file that fails verification on load is set aside as
``<name>.corrupt`` and the previous copy is used instead.

Parameter files are safetensors with a sha256 of the tensor bytes in their
metadata, so silent corruption is caught too.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from trainer_lite.params import param_hash

log = logging.getLogger(__name__)


class StateError(RuntimeError):
    """State on disk is unusable and no good copy is left."""


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, *, keep_previous: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if keep_previous and path.exists():
            os.replace(path, path.with_name(path.name + ".prev"))
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any, *, keep_previous: bool = False) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), keep_previous=keep_previous)


def encode_arrays(arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> bytes:
    """safetensors bytes with ``meta`` and a checksum of the arrays in the metadata."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    header = {"meta": json.dumps(meta or {}, sort_keys=True), "sha256": param_hash(arrays)}
    return st_save(arrays, metadata=header)


def decode_arrays(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Inverse of ``encode_arrays``; raises ``ValueError`` if the checksum does not match."""
    try:
        arrays = st_load(data)
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])["__metadata__"]
        meta = json.loads(header["meta"])
        expected = header["sha256"]
    except (SafetensorError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise ValueError(f"unreadable array file: {exc}") from None
    if param_hash(arrays) != expected:
        raise ValueError("array file checksum mismatch")
    return arrays, meta


def save_arrays(path: str | Path, arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> None:
    """Atomically write arrays + meta, keeping the previous good copy as ``.prev``."""
    atomic_write_bytes(path, encode_arrays(arrays, meta), keep_previous=True)


def load_arrays(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """Load verified arrays, falling back to ``.prev``; ``None`` if neither exists.

    Raises
    ------
    StateError
        When files exist but none verifies.
    """
    path = Path(path)
    candidates = [path, path.with_name(path.name + ".prev")]
    if not any(p.exists() for p in candidates):
        return None
    for candidate in candidates:
        if not candidate.exists():
            continue
        try:
            return decode_arrays(candidate.read_bytes())
        except (OSError, ValueError) as exc:
            log.error("state file %s is corrupt (%s); trying the previous copy", candidate, exc)
            os.replace(candidate, candidate.with_name(candidate.name + ".corrupt"))
    raise StateError(f"no good copy of {path} (corrupt copies set aside as *.corrupt)")

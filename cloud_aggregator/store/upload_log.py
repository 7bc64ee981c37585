"""Large uploads kept in append-only files beside the store, not inside SQLite.

``SqliteStore.put_update`` keeps every upload until the round's checkpoint or record covers it
(``cloud_aggregator.store.sqlite``).  A 600 kB upload (150k float32 parameters) written as a SQLite
blob costs ~1.6 ms of CPU on this 2-core machine: ~150 overflow pages, each checksummed into the
WAL, copied into the database at the WAL's checkpoint and freed again when the round closes; a
4 kB one still costs overflow pages (:data:`MIN_BYTES`).
Here the payload is appended to one file per task, round and phase (``uploads/<task>/<round>-
<phase>.log``) and the ``updates`` row keeps only its offset and length.

Crash safety is the store's: the bytes are written (to the page cache, like a WAL commit under
``synchronous=NORMAL``) before the row that points at them commits, so a SIGKILL at any instant
leaves every committed row readable, and bytes no row points at (an upload whose row never
committed, a duplicate) are ignored.  A file goes when the round's record commits, and is emptied
whenever a checkpoint has folded every upload stored in it: the disk holds the uploads since
the last checkpoint, not the round's N.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

#: Payloads from this size on go to the log; smaller ones stay in the row.  A 4 kB upload (1k
#: float32 parameters) does not fit a 4 kB page: as a blob it costs overflow pages in the WAL, their
#: copy into the database at the WAL's checkpoint and their freeing at the round's checkpoint, ~20 µs
#: of the collecting thread's CPU (``benchmarks.ingest_thread``); appended here with its batch, ~2.
MIN_BYTES = 1024
#: Buffers one ``writev`` takes at most (POSIX ``IOV_MAX`` on Linux).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16


class UploadLog:
    """Append-only upload files under ``folder``; the caller (the store) serializes the calls."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._open: dict[tuple[str, int, str], int] = {}  # (task, round, phase) -> fd

    def _file(self, task: str, round_: int, phase: str) -> Path:
        return self.folder / task / f"{round_}-{phase}.log"

    def append(self, task: str, round_: int, phase: str, payload: bytes) -> int:
        """Write ``payload`` at the end of the round's file; its offset there."""
        return self.append_many(task, round_, phase, [payload])[0]

    def append_many(self, task: str, round_: int, phase: str, payloads: Sequence[bytes]) -> list[int]:
        """Write ``payloads`` one after the other at the end of the round's file, in one system
        call where the kernel takes them all (a batch of 4 kB uploads: one ``writev``, not a seek
        and a write each); their offsets there."""
        key = (task, round_, phase)
        fd = self._open.get(key)
        if fd is None:
            path = self._file(*key)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._open[key] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        at = os.lseek(fd, 0, os.SEEK_END)
        offsets = []
        for payload in payloads:
            offsets.append(at)
            at += len(payload)
        views = [memoryview(p) for p in payloads if len(p)]
        i = 0
        while i < len(views):
            written = os.writev(fd, views[i : i + _IOV_MAX])
            while i < len(views) and written >= len(views[i]):  # the buffers written whole
                written -= len(views[i])
                i += 1
            if written:  # a short write ends inside this one
                views[i] = views[i][written:]
        return offsets

    def read(self, task: str, round_: int, phase: str, at: int, length: int) -> bytes | None:
        """The payload stored at ``at``; ``None`` (logged) if the file lost it."""
        try:
            with self._file(task, round_, phase).open("rb") as fh:
                fh.seek(at)
                data = fh.read(length)
        except OSError as exc:
            log.error("upload log of %s round %d/%s unreadable: %s", task, round_, phase, exc)
            return None
        if len(data) != length:
            log.error(
                "upload log of %s round %d/%s is short at %d: an upload is lost", task, round_, phase, at
            )
            return None
        return data

    def empty(self, task: str, round_: int, phase: str) -> None:
        """Every upload in the round's file is folded into a checkpoint: give its space back."""
        fd = self._open.get((task, round_, phase))
        if fd is not None:
            os.ftruncate(fd, 0)

    def drop(self, task: str, before: tuple[int, str] | None = None) -> None:
        """Remove ``task``'s files of rounds before ``before = (round, phase)`` and of that one
        (all of them when ``None``)."""
        for key in [k for k in self._open if k[0] == task]:
            if before is None or key[1] < before[0] or key[1:] == before:
                os.close(self._open.pop(key))
        if before is None:
            shutil.rmtree(self.folder / task, ignore_errors=True)
            return
        round_, phase = before
        with contextlib.suppress(FileNotFoundError):
            for path in (self.folder / task).glob("*.log"):
                r, _, p = path.stem.partition("-")
                if r.isdigit() and (int(r) < round_ or (int(r) == round_ and p == phase)):
                    path.unlink(missing_ok=True)

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

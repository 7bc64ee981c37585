"""A bounded, append-only JSON-lines log that survives kills: the row feed and the answer log.

Files: ``<name>.jsonl`` (being written) and ``<name>.jsonl.1`` … ``.<keep>`` (older).
Each record is one ``os.write`` of a whole line on an ``O_APPEND`` descriptor, so a
killed writer loses at most the line it was writing; the next writer to open the file
ends a torn last line with a newline first, and every reader skips (and counts) a line
that is not a JSON object.  No fsync per line: a kill of the process leaves the
written lines to the kernel; a power cut may lose the last seconds.

Rotation: when the current file reaches ``max_bytes`` or is older than ``max_age_s``
it becomes ``.1`` (``.1`` becomes ``.2`` …, the oldest beyond ``keep`` is deleted), so
the log never holds more than about ``(keep + 1) × max_bytes``.

:class:`Tail` follows a log as ``tail -F`` does: it keeps the file it reads open, so a
rotation under it loses nothing; it then opens the new current file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class JsonLinesLog:
    """The writing side of one log (one writer process per log)."""

    def __init__(
        self, path: Path, *, max_bytes: int = 1 << 20, max_age_s: float = 86400.0, keep: int = 4
    ) -> None:
        if max_bytes < 1 or keep < 1 or not max_age_s > 0:
            raise ValueError("a log needs max_bytes >= 1, keep >= 1 and max_age_s > 0")
        self.path = Path(path)
        self.max_bytes, self.max_age_s, self.keep = int(max_bytes), float(max_age_s), int(keep)
        self.rotations = 0
        self._fd: int | None = None
        self._size = 0
        self._opened_at = 0.0

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        st = os.fstat(fd)
        self._size = st.st_size
        # A file's age runs from its creation here: mtime moves with every line, ctime too.
        self._opened_at = time.time() if st.st_size == 0 else min(time.time(), _born(self.path, st))
        if st.st_size and not _ends_with_newline(self.path):
            os.write(fd, b"\n")  # a writer was killed mid-line: that fragment stays a line of its own
            self._size += 1
        self._fd = fd
        return fd

    def append(self, record: dict[str, Any] | str) -> None:
        """Write one record (a dict, or a JSON object already encoded) as one line."""
        line = record if isinstance(record, str) else json.dumps(record, separators=(",", ":"))
        self.append_line(line.encode())

    def append_line(self, encoded: bytes) -> None:
        """Write one JSON object already encoded as UTF-8 bytes (no newline) as one line."""
        data = encoded + b"\n"
        fd = self._fd if self._fd is not None else self._open()
        if self._size and (
            self._size + len(data) > self.max_bytes or time.time() - self._opened_at > self.max_age_s
        ):
            fd = self._rotate()
        os.write(fd, data)
        self._size += len(data)

    def _rotate(self) -> int:
        self.close()
        oldest = self.path.with_name(f"{self.path.name}.{self.keep}")
        oldest.unlink(missing_ok=True)
        for i in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(
                    self.path.with_name(f"{self.path.name}.{i}"),
                    self.path.with_name(f"{self.path.name}.{i + 1}"),
                )
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self.rotations += 1
        fd = self._open()
        with contextlib.suppress(OSError):  # its age starts now (the inode may be reused)
            _set_born(self.path, time.time())
        self._opened_at = time.time()
        return fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def files(self) -> list[Path]:
        """The log's files, oldest first."""
        return log_files(self.path)


def _born_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.born")


def _born(path: Path, st: os.stat_result) -> float:
    """When the current file was started (a side file written at rotation; else its mtime)."""
    try:
        return float(_born_path(path).read_text())
    except (OSError, ValueError):
        return st.st_mtime


def _set_born(path: Path, t: float) -> None:
    _born_path(path).write_text(repr(t))


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def log_files(path: Path) -> list[Path]:
    """``path.N`` … ``path.1``, ``path``: those that exist, oldest first."""
    path = Path(path)
    rotated = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1 :]
        if suffix.isdigit():
            rotated.append((int(suffix), p))
    return [p for _, p in sorted(rotated, reverse=True)] + ([path] if path.exists() else [])


def parse_line(line: bytes) -> dict[str, Any] | None:
    """A line's JSON object, ``None`` for a torn or foreign line."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def read_log(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Every record of a log, oldest first, and the number of lines skipped (torn or not JSON)."""
    records, skipped = [], 0
    for p in log_files(path):
        with contextlib.suppress(FileNotFoundError), open(p, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                obj = parse_line(line)
                if obj is None:
                    skipped += 1
                else:
                    records.append(obj)
    return records, skipped


class Tail:
    """Follows a :class:`JsonLinesLog` from a position (``(inode, offset)``), across rotations.

    A line without its newline yet is held back until it is complete; a line that never
    parses (torn by a killed writer) is skipped and counted in ``skipped``.
    """

    def __init__(self, path: Path, position: tuple[int, int] | None = None) -> None:
        self.path = Path(path)
        self.skipped = 0
        self._f = None
        self._ino: int | None = None
        self._partial = b""
        if position is not None:
            self._open_at(*position)

    def _open_at(self, ino: int, offset: int) -> None:
        """Resume at ``offset`` of the file with inode ``ino``: the current one, or a rotated one."""
        for p in reversed(log_files(self.path)):
            with contextlib.suppress(OSError):
                if p.stat().st_ino == ino:
                    self._f = open(p, "rb")  # noqa: SIM115 -- held open across calls on purpose
                    self._ino = ino
                    self._f.seek(min(offset, p.stat().st_size))
                    return
        # The file read before is gone (rotated out): start at the oldest one left.
        files = log_files(self.path)
        if files:
            self._f = open(files[0], "rb")  # noqa: SIM115
            self._ino = os.fstat(self._f.fileno()).st_ino

    @property
    def position(self) -> tuple[int, int] | None:
        """Where the next line starts: save it to resume after a restart."""
        if self._f is None or self._ino is None:
            return None
        return self._ino, self._f.tell() - len(self._partial)

    def read(self) -> Iterator[dict[str, Any]]:
        """The complete records written since the last call."""
        while True:
            if self._f is None:
                try:
                    self._f = open(self.path, "rb")  # noqa: SIM115
                except FileNotFoundError:
                    return
                self._ino = os.fstat(self._f.fileno()).st_ino
            yield from self._lines()
            newer = self._newer_file()
            if newer is None:
                return
            yield from self._lines()  # the last lines written before the rotation
            if self._partial:
                self.skipped += 1  # a torn line at the end of a rotated file
                self._partial = b""
            self._f.close()
            try:
                self._f = open(newer, "rb")  # noqa: SIM115
            except FileNotFoundError:
                self._f = None
                return
            self._ino = os.fstat(self._f.fileno()).st_ino

    def _newer_file(self) -> Path | None:
        """The current file, when it is not the one held (a rotation happened)."""
        try:
            ino = self.path.stat().st_ino
        except FileNotFoundError:
            return None
        return self.path if ino != self._ino else None

    def _lines(self) -> Iterator[dict[str, Any]]:
        assert self._f is not None
        chunk = self._f.read()
        if not chunk:
            return
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            obj = parse_line(line)
            if obj is None:
                self.skipped += 1
                log.warning(
                    "%s: skipped a line that is not a JSON object (torn by a killed writer?)", self.path
                )
            else:
                yield obj

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

"""Watched-folder source: each weld the monitoring system exports becomes one :class:`WeldRecording`.

A file is picked up only once it is complete, by either of two signals:

* a **marker** ``<file>.done`` or ``<stem>.done`` written after the data (and sidecar);
* a **stable** file: its size and mtime (and its sidecar's) unchanged for ``settle_s``
  seconds of this process's own observation (mtime alone is not enough: copy tools
  preserve it while the bytes still arrive).

A stable file whose header still promises more data than it holds is waited for up
to ``incomplete_timeout_s`` and then rejected.  Every decision is written to a
:class:`~sensors.welding.ledger.WeldLedger` before the weld is handed over, so a
restarted daemon never delivers a weld twice: files are matched by name, size and
mtime, then by content digest, then by weld id.  Delivery is therefore at most once; a
crash between :meth:`WatchedFolderSource.read` returning and the caller storing the
row loses that weld (its file stays on disk).  Unreadable files are moved to
``rejected/`` beside a ``<name>.reason.json`` saying why, with one log line; the source never
raises on a bad file, so one hostile file never stops the rest of the folder.  A file over
``max_file_bytes`` is rejected from its size alone, before it is read; a symbolic link is
never followed (one line the first time it is seen, then left alone).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sensors.files import printable
from sensors.welding.folder_config import FolderSourceConfig
from sensors.welding.formats import WELD_SUFFIXES, read_weld_file, sidecar_path
from sensors.welding.ledger import LedgerEntry, WeldLedger, atomic_write_text
from sensors.welding.recording import (
    WeldDataError,
    WeldRecording,
)
from sensors.welding.tables import MAX_FILE_SETTING
from sensors.welding.wavfile import IncompleteWeldFileError

log = logging.getLogger(__name__)


@dataclass
class _Seen:
    signature: tuple[int, ...]
    since: float
    incomplete_since: float | None = None


@dataclass
class FolderStats:
    """Counters since :meth:`WatchedFolderSource.setup`."""

    delivered: int = 0
    rejected: int = 0
    duplicates: int = 0
    rejections: list[tuple[str, str]] = field(default_factory=list)


class WatchedFolderSource:
    """Deliver each completely written weld file in a folder once, oldest first.

    Follows the sensor driver contract: ``setup()``, ``read()``, ``close()``.  Not
    thread-safe: one consumer per folder.

    Parameters
    ----------
    config
        See :class:`FolderSourceConfig`.
    clock
        Monotonic clock (tests pass a fake one to step through ``settle_s``).
    """

    def __init__(self, config: FolderSourceConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self._ledger: WeldLedger | None = None
        self._unmovable: set[str] = set()
        self._links: set[str] = set()  # links already named in the log
        self.stats = FolderStats()

    def setup(self) -> None:
        """Check the folder, create the sub-folders and open the ledger."""
        folder = self.config.folder
        if not folder.is_dir():
            raise FileNotFoundError(
                f"weld export folder {folder} does not exist; create it or fix the config"
            )
        for sub in (self.config.rejected_dir, self.config.done_dir):
            (folder / sub).mkdir(exist_ok=True)
        self._ledger = WeldLedger(self.config.ledger_path)
        self.stats = FolderStats()

    def __enter__(self) -> WatchedFolderSource:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the ledger (idempotent)."""
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    @property
    def ledger(self) -> WeldLedger:
        """The open ledger."""
        if self._ledger is None:
            raise RuntimeError("WatchedFolderSource.setup() has not been called (or close() was)")
        return self._ledger

    def read(self) -> WeldRecording | None:
        """The next complete, not yet delivered weld, or ``None`` if none is ready now."""
        for path in self._ready_files():
            recording = self._handle(path)
            if recording is not None:
                return recording
        return None

    def read_all(self) -> list[WeldRecording]:
        """Every weld ready now, oldest first."""
        out = []
        while (rec := self.read()) is not None:
            out.append(rec)
        return out

    def watch(self, stop: threading.Event, *, poll_s: float = 0.5) -> Iterator[WeldRecording]:
        """Yield welds as they become ready until ``stop`` is set."""
        while not stop.is_set():
            rec = self.read()
            if rec is None:
                stop.wait(poll_s)
            else:
                yield rec

    # -- scanning -------------------------------------------------------------------------

    def _candidates(self) -> list[Path]:
        out = []
        with os.scandir(self.config.folder) as it:
            for entry in it:
                name = entry.name
                if name.startswith("."):
                    continue
                if entry.is_symlink():
                    if name not in self._links and Path(name).suffix.lower() in WELD_SUFFIXES:
                        self._links.add(name)
                        log.warning("ignored %s: a symbolic link (links are never followed)", printable(name))
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                if Path(name).suffix.lower() in WELD_SUFFIXES:
                    out.append(Path(entry.path))
        return out

    def _marker(self, path: Path) -> Path | None:
        for cand in (
            path.with_name(path.name + self.config.marker_suffix),
            path.with_name(path.stem + self.config.marker_suffix),
        ):
            if cand.exists():
                return cand
        return None

    def _signature(self, path: Path) -> tuple[int, ...] | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        sig = (st.st_size, st.st_mtime_ns)
        side = sidecar_path(path)
        try:
            sst = side.stat()
            sig += (sst.st_size, sst.st_mtime_ns)
        except FileNotFoundError:
            pass
        return sig

    def _ready_files(self) -> list[Path]:
        now = self._clock()
        ready: list[tuple[int, str, Path]] = []
        names = set()
        for path in self._candidates():
            names.add(path.name)
            sig = self._signature(path)
            if sig is None:
                continue
            known = self.ledger.by_file(path.name, sig[0], sig[1])
            if known is not None:
                self._finish_known(path, known)
                continue
            seen = self._seen.get(path.name)
            if seen is None or seen.signature != sig:
                seen = self._seen[path.name] = _Seen(sig, now)
            marker = self._marker(path)
            if self.config.require_marker and marker is None:
                continue
            if marker is not None or now - seen.since >= self.config.settle_s:
                ready.append((sig[1], path.name, path))
        for gone in set(self._seen) - names:
            del self._seen[gone]
        return [p for _, _, p in sorted(ready)]

    # -- handling one file ----------------------------------------------------------------

    def _handle(self, path: Path) -> WeldRecording | None:
        sig = self._signature(path)
        if sig is None:
            return None
        if sig[0] > self.config.max_file_bytes:  # neither hashed nor read: it may be a sparse giant
            reason = (
                f"{sig[0]} bytes, more than the {self.config.max_file_bytes} this device reads "
                f"(raise {MAX_FILE_SETTING} if such welds are real)"
            )
            self._decide(path, sig, "", "rejected", "", reason)
            return None
        try:
            digest = _sha256(path)
        except OSError as exc:
            log.warning("cannot read %s yet: %s", path, exc)
            return None
        same = self.ledger.by_digest(digest)
        if same is not None:
            reason = f"same bytes as {same.name} ({same.status})"
            self._decide(path, sig, digest, "duplicate", same.weld_id, reason)
            return None
        recording = self._read(path, sig, digest)
        if recording is None or self._signature(path) != sig:  # the writer resumed while we read
            return None  # look again later
        return self._deliver(path, sig, digest, recording)

    def _read(self, path: Path, sig: tuple[int, ...], digest: str) -> WeldRecording | None:
        """The file's weld; ``None`` when it is rejected here or not finished yet (waited for)."""
        try:
            return read_weld_file(
                path,
                default_channels=self.config.default_channels,
                min_sample_rate=self.config.min_sample_rate,
                max_bytes=self.config.max_file_bytes,
            )
        except IncompleteWeldFileError as exc:
            seen = self._seen[path.name]
            now = self._clock()
            if seen.incomplete_since is None:
                seen.incomplete_since = now
            # Age by our own observation or by the file's mtime, so a restart does not reset it.
            age = max(now - seen.incomplete_since, time.time() - sig[1] / 1e9)
            if self._marker(path) is None and age < self.config.incomplete_timeout_s:
                log.debug("waiting for %s: %s", path.name, exc)
                return None
            self._decide(path, sig, digest, "rejected", "", f"incomplete: {exc}")
        except (WeldDataError, OSError, UnicodeDecodeError) as exc:
            self._decide(path, sig, digest, "rejected", "", str(exc))
        except MemoryError:  # within the cap, yet more than this device has free
            reason = f"too large to decode in this device's free memory ({sig[0]} bytes)"
            self._decide(path, sig, digest, "rejected", "", reason)
        return None

    def _deliver(
        self, path: Path, sig: tuple[int, ...], digest: str, recording: WeldRecording
    ) -> WeldRecording | None:
        """Hand the weld over unless its weld id was delivered before (a renamed weld id is new)."""
        earlier = self.ledger.by_weld_id(recording.weld_id)
        if earlier is not None and recording.meta.get("weld_id_source") == "file name":
            # An exporter that reuses file names: different bytes, so a new weld.
            recording = dataclasses.replace(recording, weld_id=f"{recording.weld_id}-{digest[:12]}")
        elif earlier is not None:
            reason = f"weld id {recording.weld_id} already delivered from {earlier.name}"
            self._decide(path, sig, digest, "duplicate", recording.weld_id, reason)
            return None
        self._decide(path, sig, digest, "delivered", recording.weld_id, "")
        return recording

    def _decide(
        self, path: Path, sig: tuple[int, ...], digest: str, status: str, weld_id: str, reason: str
    ) -> None:
        """Record the decision durably, then act on the file."""
        entry = LedgerEntry(path.name, sig[0], sig[1], digest, status, weld_id, reason)
        self.ledger.record(entry)
        self._seen.pop(path.name, None)
        if status == "rejected":
            self.stats.rejected += 1
            self.stats.rejections.append((path.name, reason))
            log.warning("rejected weld file %s: %s", printable(path.name), printable(reason))
        elif status == "duplicate":
            self.stats.duplicates += 1
            log.info("skipped %s: %s", printable(path.name), printable(reason))
        else:
            self.stats.delivered += 1
        self._finish_known(path, entry)

    def _finish_known(self, path: Path, entry: LedgerEntry) -> None:
        """Move/delete a handled file per policy (also completes a move a crash interrupted)."""
        if entry.status == "rejected":
            self._move_group(path, self.config.folder / self.config.rejected_dir)
            reason = {"file": path.name, "reason": entry.reason, "sha256": entry.sha256, "at": entry.at}
            target = self.config.folder / self.config.rejected_dir / f"{path.name}.reason.json"
            try:
                atomic_write_text(target, json.dumps(reason, indent=1))
            except OSError as exc:
                log.warning("cannot write %s: %s", target, exc)
        elif self.config.on_done == "move":
            self._move_group(path, self.config.folder / self.config.done_dir)
        elif self.config.on_done == "delete":
            for part in self._group(path):
                part.unlink(missing_ok=True)

    def _group(self, path: Path) -> list[Path]:
        parts = [path, sidecar_path(path)]
        parts += [
            path.with_name(path.name + self.config.marker_suffix),
            path.with_name(path.stem + self.config.marker_suffix),
        ]
        return [p for p in parts if p.exists()]

    def _move_group(self, path: Path, target_dir: Path) -> None:
        if path.name in self._unmovable:
            return
        for part in self._group(path):
            try:
                shutil.move(str(part), str(target_dir / part.name))
            except OSError as exc:  # read-only share: the ledger entry already marks it
                log.warning(
                    "cannot move %s to %s (left in place, ledger marks it): %s", part, target_dir, exc
                )
                self._unmovable.add(path.name)


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()

"""What both recorders share: the dataset appender with its deterministic split, and the loop.

The split rule and the crash-safety argument are in :mod:`edge.recording` (the package docstring)."""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from edge.config import SensorsConfig
from edge.dataset import DIR as DATASET_DIR
from edge.feed import STATUS_FILE, RowFeed
from edge.segment_writer import SegmentWriter
from edge.segments import DatasetReader
from ioft_protocol.service import Notifier
from ioft_protocol.state import StateError, atomic_write_json

log = logging.getLogger(__name__)


class RecorderError(RuntimeError):
    """A setup problem the recorder cannot run with (exit status 2): fix the config or the state."""


# ----------------------------------------------------------------------------- split
def hash_fraction(device: str, key: str) -> float:
    """``sha256(device NUL key)``'s first 8 bytes as a fraction in [0, 1)."""
    digest = hashlib.sha256(f"{device}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_for(device: str, key: str, test_fraction: float, *, train_empty: bool = False) -> str:
    """``"train"`` or ``"test"`` for the unit ``key`` (see the module docstring)."""
    if train_empty:
        return "train"
    return "test" if hash_fraction(device, key) < test_fraction else "train"


# ----------------------------------------------------------------------------- dataset
class DatasetAppender:
    """The device's dataset, appended to one segment per flush (:mod:`edge.segments`).

    Rows are buffered by :meth:`add` and written by :meth:`flush` as one new segment,
    atomically (temp file, fsync, rename, fsync folder): a flush that returned ``True``
    survives a kill or a power cut.  A write that fails (disk full) keeps the rows
    buffered for the next flush, so nothing is lost or half-written.  After a write the
    segment tail is compacted (:meth:`edge.segment_writer.SegmentWriter.tidy`); a failed
    compaction is logged and tried again after the next append, the rows stay stored.
    The rows themselves are not kept in memory: only their counts.
    """

    #: Compaction: unsealed segments merged at a time, and the size that seals a segment.
    fanout = 32
    seal_bytes = 128 * 1024

    def __init__(
        self,
        state_dir: Path,
        *,
        source: str,
        x_dim: int,
        y_dtype: type,
        y_1d: bool,
        meta: dict[str, Any],
        check_meta: Callable[[dict], list[str]] | None = None,
        max_rows: int = 100_000,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.max_rows = int(max_rows)
        self.x_dim = int(x_dim)
        reader = DatasetReader(self.state_dir)
        try:
            loaded = reader.load()
        except StateError as exc:
            raise RecorderError(f"{self.state_dir / DATASET_DIR}: {exc}") from None
        self.y_dtype = np.dtype(y_dtype)
        if loaded is None:
            self.meta = dict(meta)
            self._count = {"train": 0, "test": 0}
        else:
            train, test, old = loaded
            problems = []
            if old.get("source") != source:
                problems.append(
                    f"it holds rows from {old.get('source')!r}, not {source!r} -- real and simulated "
                    "(or printer and welder) rows must not be mixed; move it aside to start a new one"
                )
            elif train.x.shape[1:] != (x_dim,) or test.x.shape[1:] != (x_dim,):
                problems.append(f"its rows have {train.x.shape[1:]} inputs, expected ({x_dim},)")
            elif check_meta is not None:
                problems += check_meta(old)
            if problems:
                raise RecorderError(
                    f"cannot append to {self.state_dir / DATASET_DIR}: " + "; ".join(problems)
                )
            self.meta = {**old, **meta}
            self._count = {"train": len(train), "test": len(test)}
            self.y_dtype = train.y.dtype  # new rows take the stored rows' label type: one dtype per dataset
        self.store = SegmentWriter(reader, fanout=self.fanout, seal_bytes=self.seal_bytes)
        del reader, loaded  # the rows are on disk; only their counts are needed here
        self._buf: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "test": []}
        self.y_1d = y_1d
        self.writes = 0
        self.write_errors = 0

    def rows(self, split: str) -> int:
        """Rows of ``split`` including those not yet written."""
        return self._count[split] + len(self._buf[split])

    def stored(self, split: str) -> int:
        """Rows of ``split`` written (after ``max_rows``)."""
        return self._count[split]

    @property
    def pending(self) -> int:
        return len(self._buf["train"]) + len(self._buf["test"])

    def add(self, split: str, x: np.ndarray, y: np.ndarray | int | float) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        y = np.asarray(y).reshape(() if self.y_1d else (1,))
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise ValueError("row holds NaN or Inf")  # the callers check first; this is the last guard
        self._buf[split].append((x, y))

    def _batch(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        rows = self._buf[split]
        if not rows:
            return np.empty((0, self.x_dim)), np.empty((0,) if self.y_1d else (0, 1), dtype=self.y_dtype)
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]).astype(self.y_dtype)

    def flush(self, meta_updates: dict[str, Any] | None = None) -> bool:
        """Write buffered rows (and ``meta_updates``) as one segment; ``True`` when the dataset is up to date."""
        if not self.pending and not meta_updates:
            return True
        meta = {**self.meta, **(meta_updates or {})}
        counts = {split: min(self.rows(split), self.max_rows) for split in self._buf}  # the oldest go first
        if not counts["train"] and not counts["test"]:
            self.meta = meta  # no file without rows: the trainer would find nothing to train on
            return True
        meta["rows"] = counts
        meta["updated_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        try:
            self.store.append(
                {split: self._batch(split) for split in self._buf}, meta, max_rows=self.max_rows
            )
        except OSError as exc:
            self.write_errors += 1
            log.error(
                "could not write to %s (%s); %d rows kept for the next try", DATASET_DIR, exc, self.pending
            )
            return False
        self.meta, self._count = meta, counts
        self._buf = {"train": [], "test": []}
        self.writes += 1
        try:
            self.store.tidy()
        except (OSError, ValueError) as exc:
            log.warning(
                "compacting %s failed (%s); the rows are stored, it is tried again later", DATASET_DIR, exc
            )
        return True


# ----------------------------------------------------------------------------- accelerometer
class RecorderLoop:
    """The shared loop: pacing on a real or virtual clock, stop, status file, error containment."""

    kind = ""
    interval_s = 0.1

    def __init__(self, device: str, state_dir: Path, cfg: SensorsConfig, clock: Callable[[], float]) -> None:
        self.device, self.state_dir, self.cfg, self.clock = device, Path(state_dir), cfg, clock
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.virtual = hasattr(clock, "advance")
        self.steps = 0
        self.appended = 0
        self.loop_errors = 0
        self.last_row_at: str | None = None
        self._next_status = -math.inf
        self._stop = threading.Event()
        self.notifier = Notifier()  # systemd's READY / WATCHDOG / STOPPING; run() takes the real one
        self.feed = RowFeed(self.state_dir)  # every new row, at once, to the trainer's serving model

    # subclasses
    def start(self) -> None: ...

    def step(self) -> int:
        raise NotImplementedError

    def finish(self) -> None: ...

    def status(self) -> dict:
        return {}

    def stop(self) -> None:
        self._stop.set()

    def _pause(self, dt: float) -> None:
        if dt <= 0:
            return
        if self.virtual:
            self.clock.advance(dt)  # type: ignore[attr-defined]
        else:
            self._stop.wait(dt)

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        until: Callable[[], bool] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        """Record until ``stop`` is set (or ``until()`` is true); then finish cleanly.

        ``notifier``: READY once the sensors are set up, a watchdog ping from every turn of
        the loop (a hung sensor read stops them, and systemd restarts the recorder), STOPPING.
        """
        if stop is not None:
            self._stop = stop
        if notifier is not None:
            self.notifier = notifier
        self.start()
        self.notifier.ready(f"{self.kind} recorder started")
        failures = 0
        try:
            while not self._stop.is_set() and not (until is not None and until()):
                self.notifier.alive()
                began = self.clock()
                try:
                    self.step()
                    failures = 0
                except Exception:  # a bug or unforeseen fault must not stop recording
                    self.loop_errors += 1
                    failures += 1
                    log.exception("recorder step failed (%d in a row); going on", failures)
                    self._pause(min(30.0, 0.5 * 2 ** min(failures, 6)))
                self.steps += 1
                self._maybe_status()
                self._pause(self.interval_s - (self.clock() - began))
        finally:
            self.notifier.stopping(f"{self.appended} rows appended this run")
            try:
                self.finish()
            finally:
                self.write_status(final=True)
                self.feed.close()
        log.info("%s recorder stopped: %d rows appended this run", self.kind, self.appended)

    def _maybe_status(self) -> None:
        now = self.clock()
        if now >= self._next_status:
            self._next_status = now + self.cfg.status_every_s
            self.write_status()
            self.notifier.status(f"{self.appended} rows appended, {self.loop_errors} loop errors")

    def write_status(self, *, final: bool = False) -> None:
        body = {
            "device": self.device,
            "kind": self.kind,
            "running": not final,
            "updated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "appended": self.appended,
            "last_row_at": self.last_row_at,
            "loop_errors": self.loop_errors,
            "serving_feed": self.feed.status(),
            **self.status(),
        }
        try:
            atomic_write_json(self.state_dir / STATUS_FILE, body)
        except (OSError, TypeError, ValueError) as exc:
            log.warning("could not write %s: %s", STATUS_FILE, exc)

    def _stored(self, n: int) -> None:
        if n:
            self.appended += n
            self.last_row_at = datetime.now(UTC).isoformat(timespec="seconds")

"""Writing the dataset's segments: appends, compaction of the tail, trimming, whole replacement.

The format and the rules that make a kill at any point harmless are in :mod:`edge.segments`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from edge.segments import (
    LEGACY,
    LEGACY_FILE,
    SEGMENT_DIR,
    SPLITS,
    DatasetReader,
    SegmentInfo,
    SegmentName,
    check_arrays,
    encode_segment,
    list_names,
    next_seq,
    read_segment,
    set_aside,
)
from ioft_protocol.state import atomic_write_bytes, fsync_dir

log = logging.getLogger(__name__)


class SegmentWriter:
    """Appends segments to one dataset and compacts its tail; one writer per dataset (the recorder).

    Parameters
    ----------
    reader : DatasetReader
        The dataset as loaded; its segments, next row ids and ``live_from`` are taken over.
    fanout : int
        Unsealed segments of one level merged at a time.
    seal_bytes : int
        A segment this large is never merged again.
    """

    def __init__(self, reader: DatasetReader, *, fanout: int = 32, seal_bytes: int = 128 * 1024) -> None:
        if fanout < 2:
            raise ValueError(f"fanout must be at least 2, got {fanout}")
        self.state_dir, self.folder = reader.state_dir, reader.folder
        self.fanout, self.seal_bytes = int(fanout), int(seal_bytes)
        self.segments = list(reader.segments)
        self.next_ids = dict(reader.next_ids)
        self.live_from = dict(reader.live_from)
        self.next_seq = next_seq(self.folder)
        self.merges = 0
        self._folder_ready = self.folder.is_dir()
        self._remove_garbage(list_names(self.folder))

    def _sealed(self, info: SegmentInfo) -> bool:
        return info.name.kind != "seg" or info.nbytes >= self.seal_bytes

    def _ensure_folder(self) -> None:
        if not self._folder_ready:
            self.folder.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.state_dir)  # the new folder's entry must survive a power cut too
            self._folder_ready = True

    def _remove_garbage(self, present: list[SegmentName]) -> None:
        """Files a kill left behind: parts of a finished merge, temp files of unfinished writes."""
        keep = {s.name for s in self.segments}
        for name in present:
            if name not in keep:
                with contextlib.suppress(OSError):
                    (self.folder / name.name).unlink()
        with contextlib.suppress(OSError):
            for entry in os.listdir(self.folder):
                if entry.startswith((".seg-", ".base-")) and entry.endswith(".tmp"):
                    (self.folder / entry).unlink()

    def append(
        self, rows: dict[str, tuple[np.ndarray, np.ndarray]], meta: dict[str, Any], *, max_rows: int
    ) -> None:
        """Write ``rows`` (per split) as one new segment; durable when this returns.

        ``max_rows`` trims each split to its newest rows (by id).  Raises ``OSError``
        when the write fails: nothing is changed then.
        """
        ids = dict(self.next_ids)
        ends = {s: ids[s] + len(rows[s][0]) for s in SPLITS}
        live_from = {s: max(self.live_from[s], ends[s] - max_rows) for s in SPLITS}
        name = SegmentName(self.next_seq, self.next_seq)
        arrays = {f"{s}_{k}": v for s in SPLITS for k, v in zip("xy", rows[s], strict=True)}
        data = encode_segment(arrays, name=name, level=0, ids=ids, live_from=live_from, meta=meta)
        self._ensure_folder()
        atomic_write_bytes(self.folder / name.name, data)
        counts = {s: len(rows[s][0]) for s in SPLITS}
        self.segments.append(SegmentInfo(name, 0, ids, counts, live_from, len(data), meta))
        self.next_seq += 1
        self.next_ids, self.live_from = ends, live_from

    def tidy(self) -> None:
        """Delete fully trimmed segments, then merge the tail while a full run of one level is there.

        Raises ``OSError`` (a failed write or read) or ``ValueError`` (a segment that no
        longer verifies); the dataset on disk is complete either way.
        """
        self._drop_trimmed()
        while self._merge_tail():
            pass

    def _drop_trimmed(self) -> None:
        dead = [
            s
            for s in self.segments[:-1]  # the newest carries the metadata: always kept
            if all(s.end(sp) <= self.live_from[sp] for sp in SPLITS)
        ]
        for s in dead:
            if s.name == LEGACY:
                for suffix in ("", ".prev"):
                    with contextlib.suppress(FileNotFoundError):
                        (self.state_dir / (LEGACY_FILE + suffix)).unlink()
            else:
                with contextlib.suppress(FileNotFoundError):
                    (self.folder / s.name.name).unlink()
        if dead:
            self.segments = [s for s in self.segments if s not in dead]

    def _merge_tail(self) -> bool:
        run: list[SegmentInfo] = []
        for s in reversed(self.segments):
            if self._sealed(s) or (run and s.level != run[0].level):
                break
            if run and any(s.end(sp) != run[0].ids[sp] for sp in SPLITS):
                break  # rows missing between them (a segment set aside): merge only what is contiguous
            run.insert(0, s)
        if len(run) < self.fanout:
            return False
        parts = []
        for s in run:
            path = self.folder / s.name.name
            try:
                parts.append(read_segment(path, s.name)[1])
            except (ValueError, KeyError, TypeError) as exc:
                set_aside(path, exc)
                self.segments.remove(s)
                return False
        last = run[-1]
        live_from = last.live_from
        merged, ids = {}, {}
        for sp in SPLITS:
            skip = max(0, live_from[sp] - run[0].ids[sp])
            ids[sp] = run[0].ids[sp] + skip
            for k in "xy":
                merged[f"{sp}_{k}"] = np.concatenate([p[f"{sp}_{k}"] for p in parts])[skip:]
        name = SegmentName(run[0].name.first, last.name.last)
        level = run[0].level + 1
        data = encode_segment(merged, name=name, level=level, ids=ids, live_from=live_from, meta=last.meta)
        atomic_write_bytes(self.folder / name.name, data)  # the switch: the cover now holds this file
        counts = {sp: len(merged[f"{sp}_x"]) for sp in SPLITS}
        self.segments = [
            *self.segments[: -len(run)],
            SegmentInfo(name, level, ids, counts, live_from, len(data), last.meta),
        ]
        for s in run:
            with contextlib.suppress(FileNotFoundError):
                (self.folder / s.name.name).unlink()
        self.merges += 1
        return True


def write_base(state_dir: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Replace the whole dataset by ``arrays``: one ``base`` segment, then the older files go."""
    state_dir = Path(state_dir)
    folder = state_dir / SEGMENT_DIR
    new_folder = not folder.is_dir()
    folder.mkdir(parents=True, exist_ok=True)
    if new_folder:
        fsync_dir(state_dir)
    older = list_names(folder)
    seq = next_seq(folder)
    name = SegmentName(seq, seq, "base")
    check_arrays(arrays)
    zero = dict.fromkeys(SPLITS, 0)
    data = encode_segment(arrays, name=name, level=0, ids=dict(zero), live_from=dict(zero), meta=meta)
    atomic_write_bytes(folder / name.name, data)
    for n in older:
        with contextlib.suppress(FileNotFoundError):
            (folder / n.name).unlink()
    for suffix in ("", ".prev"):
        with contextlib.suppress(FileNotFoundError):
            (state_dir / (LEGACY_FILE + suffix)).unlink()

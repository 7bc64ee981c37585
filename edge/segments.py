"""The device's dataset on disk as append-only segments.

Layout, in ``<state_dir>/dataset.segments/``::

    seg-00000001-00000001.safetensors    one append (sequence numbers first-last)
    seg-00000002-00000033.safetensors    32 appends merged by compaction
    base-00000040-00000040.safetensors   a whole dataset written at once (``save_dataset``)

Each segment is a checksummed safetensors file (:func:`ioft_protocol.state.encode_arrays`:
the tensors and the metadata are both verified on read) holding ``train_x``, ``train_y``,
``test_x``, ``test_y`` (optionally ``train_domain``/``test_domain``) and in its metadata
``segment`` (sequence range, merge level, the id of its first row in each split, and
``live_from``: rows of lower id were trimmed by ``max_rows``) and ``dataset``: the
dataset's metadata as of that write.  The newest segment's ``dataset`` is the dataset's.

**The folder listing is the index.**  A segment is written to a temp file, fsync'ed and
renamed into place (then the folder fsync'ed); that rename is the commit.  The dataset
is the *cover*: from the newest ``base`` on (or, without one, the single-file
``dataset.safetensors`` of older versions read as is, then every segment), each sequence
number exactly once, the widest file winning.  Compaction writes the merged file and
only then deletes its parts, so a kill at any point leaves either the parts or the
merged file in the cover -- never both, never neither.  An index file rewritten on every
append would cost bytes in proportion to the number of segments; the names cost none.

Compaction (:class:`edge.segment_writer.SegmentWriter`, after each append, in the recorder) merges a
trailing run of ``fanout`` unsealed segments of the same level into one of the next
level; a segment is sealed once it holds ``seal_bytes``.  A weld row (5 kB) is so
written twice (its append, one merge into a sealed 32-row segment); a printer row
(16 bytes) a few times, in files of a few kB.  Fully trimmed segments are deleted.

A segment that fails verification is set aside as ``*.corrupt`` and the dataset loads
without its rows (logged as an error): for the newest segment that is the dataset as
before its append, what ``.prev`` gave the single file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge.folder_listing import FolderListing
from ioft_protocol.state import StateError, decode_arrays, encode_arrays, load_verified
from trainer_lite.data import Dataset

log = logging.getLogger(__name__)

SEGMENT_DIR = "dataset.segments"
LEGACY_FILE = "dataset.safetensors"
SPLITS = ("train", "test")
_NAME = re.compile(r"^(seg|base)-(\d{8,})-(\d{8,})\.safetensors$")
#: Any file of a segment, set aside ones (``*.corrupt``) included: their numbers are never reused.
_ANY = re.compile(r"^(?:seg|base)-\d{8,}-(\d{8,})\.safetensors")


class _Vanished(Exception):  # noqa: N818 -- internal signal: a listed file went away (compaction)
    """A segment in the listing was gone when read: list again."""


@dataclass(frozen=True, order=True)
class SegmentName:
    """A segment's place in the sequence, as its file name says."""

    first: int
    last: int
    kind: str = "seg"

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.first:08d}-{self.last:08d}.safetensors"

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        m = _NAME.match(name)
        if m is None:
            return None
        return cls(int(m.group(2)), int(m.group(3)), m.group(1))


#: The single file of older versions, read as the oldest segment (sequence number 0).
LEGACY = SegmentName(0, 0, "legacy")


@dataclass
class SegmentInfo:
    """What is known of a segment once read (its rows are not kept here)."""

    name: SegmentName
    level: int
    ids: dict[str, int]
    rows: dict[str, int]
    live_from: dict[str, int]
    nbytes: int
    meta: dict[str, Any] = field(repr=False)

    def end(self, split: str) -> int:
        """One past the id of this segment's last row of ``split``."""
        return self.ids[split] + self.rows[split]


def cover(names: list[SegmentName]) -> list[SegmentName]:
    """The segments that make up the dataset, oldest first (see the module docstring)."""
    ordered = sorted({n for n in names if n.kind != "legacy"}, key=lambda n: (n.first, -n.last))
    start = max((n.first for n in ordered if n.kind == "base"), default=0)
    out: list[SegmentName] = []
    nxt = start
    for n in ordered:
        if n.first < nxt:  # subsumed by a merged file (or older than the base); never read twice
            continue
        out.append(n)
        nxt = n.last + 1
    return out


def list_names(folder: Path) -> list[SegmentName]:
    """Every segment name in ``folder`` (empty when it does not exist)."""
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return []
    return [n for n in map(SegmentName.parse, entries) if n is not None]


def next_seq(folder: Path) -> int:
    """A sequence number no file in ``folder`` has used."""
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return 1
    return max((int(m.group(1)) for m in map(_ANY.match, entries) if m is not None), default=0) + 1


def encode_segment(
    arrays: dict[str, np.ndarray],
    *,
    name: SegmentName,
    level: int,
    ids: dict[str, int],
    live_from: dict[str, int],
    meta: dict[str, Any],
) -> bytes:
    """The bytes of a segment file (checksummed safetensors)."""
    header = {"seq": [name.first, name.last], "level": level, "ids": ids, "live_from": live_from}
    return encode_arrays(arrays, {"segment": header, "dataset": meta})


def check_arrays(arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Rows per split; ``ValueError`` naming what is missing or inconsistent."""
    rows = {}
    for split in SPLITS:
        x, y = arrays.get(f"{split}_x"), arrays.get(f"{split}_y")
        if x is None or y is None:
            raise ValueError(f"no {split}_x/{split}_y arrays")
        if x.ndim != 2 or len(y) != len(x):
            raise ValueError(f"{split} arrays disagree: x {x.shape}, y {y.shape}")
        dom = arrays.get(f"{split}_domain")
        if dom is not None and len(dom) != len(x):
            raise ValueError(f"{split}_domain has {len(dom)} rows, x {len(x)}")
        rows[split] = len(x)
    if arrays["train_x"].shape[1] != arrays["test_x"].shape[1]:
        raise ValueError(
            f"train and test rows differ in width: {arrays['train_x'].shape[1]}, {arrays['test_x'].shape[1]}"
        )
    return rows


def read_segment(path: Path, name: SegmentName) -> tuple[SegmentInfo, dict[str, np.ndarray]]:
    """A verified segment; ``ValueError`` (or ``KeyError``/``TypeError``) when it is not one.

    Raises
    ------
    FileNotFoundError
        When the file is gone (compaction deleted it after merging it).
    """
    data = path.read_bytes()
    arrays, meta = decode_arrays(data)
    seg, dataset_meta = meta["segment"], meta["dataset"]
    if not isinstance(dataset_meta, dict):
        raise ValueError("segment metadata holds no dataset object")
    if list(seg["seq"]) != [name.first, name.last]:
        raise ValueError(f"holds sequence numbers {seg['seq']}, its name says {name.first}-{name.last}")
    ids = {s: int(seg["ids"][s]) for s in SPLITS}
    live_from = {s: int(seg["live_from"][s]) for s in SPLITS}
    info = SegmentInfo(name, int(seg["level"]), ids, check_arrays(arrays), live_from, len(data), dataset_meta)
    return info, arrays


def _read_legacy(state_dir: Path) -> tuple[SegmentInfo, dict[str, np.ndarray]] | None:
    """The single file of older versions (``.prev`` if it is corrupt), as the oldest segment."""

    def parse(arrays: dict[str, np.ndarray], meta: dict) -> tuple[SegmentInfo, dict[str, np.ndarray]]:
        rows = check_arrays(arrays)
        zero = dict.fromkeys(SPLITS, 0)
        return SegmentInfo(LEGACY, 0, dict(zero), rows, dict(zero), 0, meta), arrays

    return load_verified(state_dir / LEGACY_FILE, parse)


def set_aside(path: Path, exc: Exception) -> None:
    """Log a segment that failed verification and rename it to ``*.corrupt``."""
    log.error("dataset segment %s is corrupt (%s); set aside, the dataset loads without its rows", path, exc)
    with contextlib.suppress(OSError):  # another process may have set it aside already
        os.replace(path, path.with_name(path.name + ".corrupt"))


class _Split:
    """One split's rows held in memory, with the id of each row."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]] = []
        self.x = self.y = self.rid = None
        self.domain: np.ndarray | None = None

    def add(self, x: np.ndarray, y: np.ndarray, domain: np.ndarray | None, first_id: int) -> None:
        self.chunks.append((x, y, domain, np.arange(first_id, first_id + len(x), dtype=np.int64)))

    def build(self, live_from: int) -> None:
        """Concatenate the chunks (the held rows first) and drop rows trimmed by ``live_from``."""
        parts = ([(self.x, self.y, self.domain, self.rid)] if self.x is not None else []) + self.chunks
        self.chunks = []
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        rid = np.concatenate([p[3] for p in parts])
        with_domain = all(p[2] is not None for p in parts)
        domain = np.concatenate([p[2] for p in parts]) if with_domain else None
        keep = int(np.searchsorted(rid, live_from)) if len(rid) else 0
        self.x, self.y, self.rid = x[keep:], y[keep:], rid[keep:]
        self.domain = domain[keep:] if domain is not None else None

    def dataset(self) -> Dataset:
        return Dataset(self.x, self.y, self.domain)


class DatasetReader:
    """The dataset read from its segments, kept in memory; :meth:`refresh` reads only new segments.

    After :meth:`load` (or a :meth:`refresh` that returns ``True``) ``train``, ``test``
    and ``meta`` hold the dataset, ``segments`` what is known of each segment of the
    cover and ``next_ids`` the id the next row of each split gets.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.folder = self.state_dir / SEGMENT_DIR
        # listed again only when the folder changed: a swarm's devices each refresh every round
        self._names = FolderListing(self.folder, lambda: cover(list_names(self.folder)), [])
        self._reset()

    def _reset(self) -> None:
        self.train = self.test = None
        self.meta: dict[str, Any] = {}
        self.segments: list[SegmentInfo] = []
        self.next_ids = dict.fromkeys(SPLITS, 0)
        self.live_from = dict.fromkeys(SPLITS, 0)
        self._splits = {s: _Split() for s in SPLITS}
        self._key: tuple | None = None
        self._base: SegmentName | None = None
        self._through = -1
        self.loaded = False

    # -- listing --------------------------------------------------------------------
    def _listing(self) -> tuple[list[SegmentName], tuple | None, tuple]:
        """The cover, the legacy file's signature when it is part of the dataset, and a key of both."""
        names = self._names.get()
        legacy = None
        if not (names and names[0].kind == "base"):
            with contextlib.suppress(FileNotFoundError):
                st = (self.state_dir / LEGACY_FILE).stat()
                legacy = (st.st_ino, st.st_mtime_ns, st.st_size)
            if legacy is None:
                with contextlib.suppress(FileNotFoundError):
                    st = (self.state_dir / (LEGACY_FILE + ".prev")).stat()
                    legacy = ("prev", st.st_ino, st.st_mtime_ns, st.st_size)
        return names, legacy, (tuple(n.name for n in names), legacy)

    # -- reading --------------------------------------------------------------------
    def _take(
        self, info: SegmentInfo, arrays: dict[str, np.ndarray], *, skip: dict[str, int] | None = None
    ) -> None:
        for split in SPLITS:
            k = (skip or {}).get(split, 0)
            x, y = arrays[f"{split}_x"][k:], arrays[f"{split}_y"][k:]
            dom = arrays.get(f"{split}_domain")
            self._splits[split].add(x, y, dom[k:] if dom is not None else None, info.ids[split] + k)
            self.next_ids[split] = max(self.next_ids[split], info.end(split))
        self.meta, self.live_from = info.meta, info.live_from
        self._through = max(self._through, info.name.last)

    def _read(self, name: SegmentName) -> tuple[SegmentInfo, dict[str, np.ndarray]] | None:
        path = self.folder / name.name
        try:
            return read_segment(path, name)
        except FileNotFoundError:
            raise _Vanished from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            set_aside(path, exc)
            return None

    def _finish(self, key: tuple) -> None:
        for split in SPLITS:
            self._splits[split].build(self.live_from[split])
        self.train, self.test = self._splits["train"].dataset(), self._splits["test"].dataset()
        self._key = key

    def _load_all(self) -> tuple[Dataset, Dataset, dict] | None:
        self._reset()
        names, legacy, key = self._listing()
        if legacy is not None:
            got = _read_legacy(self.state_dir)  # StateError when no copy verifies
            if got is not None:
                self.segments.append(got[0])
                self._take(*got)
        for name in names:
            got = self._read(name)
            if got is not None:
                self.segments.append(got[0])
                self._take(*got)
        self._base = names[0] if names and names[0].kind == "base" else None
        if not self.segments:
            self._key = key
            if names:
                raise StateError(f"no good segment in {self.folder} (corrupt ones set aside as *.corrupt)")
            return None
        self._finish(key)
        self.loaded = True
        return self.train, self.test, self.meta

    def load(self) -> tuple[Dataset, Dataset, dict] | None:
        """Read the whole dataset; ``None`` if none was ever written.

        Raises
        ------
        StateError
            When files exist but none verifies.
        """
        for _ in range(5):
            try:
                return self._load_all()
            except _Vanished:
                continue  # compaction replaced a file between listing and reading: list again
        raise StateError(
            f"{self.folder}: segments kept vanishing while being read; is a second recorder running?"
        )

    def refresh(self) -> bool:
        """Read the segments added since the last read; ``True`` when the rows or the metadata changed.

        Segments already read and since merged by compaction are not read again: their
        sequence numbers (and so their row ids) are covered already.  A new base, a
        changed single file or rows whose ids do not continue the ones held mean a full
        reload.
        """
        for _ in range(5):
            names, legacy, key = self._listing()
            if key == self._key:
                return False
            base = names[0] if names and names[0].kind == "base" else None
            try:
                if not self.loaded or base != self._base or legacy != self._key[1]:
                    return self._load_all() is not None
                return self._extend(names, key)
            except _Vanished:
                continue
        return False

    def _extend(self, names: list[SegmentName], key: tuple) -> bool:
        changed = False
        for name in names:
            if name.last <= self._through:
                continue  # rows held already (possibly merged since into a wider file)
            got = self._read(name)
            if got is None:
                continue
            info, arrays = got
            skip = {}
            for split in SPLITS:
                k = self.next_ids[split] - info.ids[split]
                straddles = name.first <= self._through
                if (straddles and not 0 <= k <= info.rows[split]) or (not straddles and k != 0):
                    log.info(
                        "dataset segment %s does not continue the rows held; reading it all again", name.name
                    )
                    return self._load_all() is not None
                skip[split] = k
            self.segments = [s for s in self.segments if s.name.last < name.first] + [info]
            self._take(info, arrays, skip=skip)
            changed = True
        if changed:
            self._finish(key)
        else:
            self._key = key
        return changed

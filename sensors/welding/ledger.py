"""A small on-disk ledger of weld files already handled, so a restart never handles one twice.

The ledger is a JSON-lines file.  Each decision (delivered, rejected, duplicate) is one
line written with a single ``write`` on an ``O_APPEND`` descriptor and fsynced before
the caller acts on it.  A power cut can at worst leave a torn last line; it is
dropped on load (that decision never took effect, because the caller only acts after
the fsync returns), and the file is then rewritten atomically (temp file, fsync,
rename, fsync of the folder).  The same atomic rewrite compacts the file when it
holds many more lines than entries and caps it at ``max_entries``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

STATUSES = ("delivered", "rejected", "duplicate")


@dataclass(frozen=True)
class LedgerEntry:
    """One handled weld file.

    Attributes
    ----------
    name
        File name within the watched folder.
    size, mtime_ns
        The file's size and modification time when it was handled.
    sha256
        Digest of the data file's bytes.
    status
        ``"delivered"``, ``"rejected"`` or ``"duplicate"``.
    weld_id
        The weld's id (empty for a rejected file that could not be read).
    reason
        Why a file was rejected or treated as a duplicate.
    at
        Unix time of the decision.
    """

    name: str
    size: int
    mtime_ns: int
    sha256: str
    status: str
    weld_id: str = ""
    reason: str = ""
    at: float = 0.0


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class WeldLedger:
    """Persistent record of handled weld files, indexed by file identity, digest and weld id.

    Parameters
    ----------
    path
        The JSON-lines file (created with its folder if missing).
    max_entries
        Oldest entries beyond this are dropped when the file is compacted.
    """

    def __init__(self, path: str | Path, *, max_entries: int = 200_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1; got {max_entries}")
        self.path = Path(path)
        self.max_entries = max_entries
        self._by_file: dict[tuple[str, int, int], LedgerEntry] = {}
        self._by_digest: dict[str, LedgerEntry] = {}
        self._by_weld: dict[str, LedgerEntry] = {}
        self._entries: list[LedgerEntry] = []
        self._fd: int | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._load()

    def _load(self) -> None:
        lines = 0
        needs_rewrite = False
        if self.path.exists():
            raw = self.path.read_text(encoding="utf-8")
            if raw and not raw.endswith("\n"):
                needs_rewrite = True
            for number, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                lines += 1
                try:
                    entry = LedgerEntry(**json.loads(line))
                except (json.JSONDecodeError, TypeError) as exc:
                    log.warning("ledger %s line %d unreadable (%s); dropped", self.path, number, exc)
                    needs_rewrite = True
                    continue
                self._index(entry)
        if needs_rewrite or lines > 2 * max(len(self._entries), 1) or len(self._entries) > self.max_entries:
            self.compact()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _index(self, entry: LedgerEntry) -> None:
        self._entries.append(entry)
        self._by_file[(entry.name, entry.size, entry.mtime_ns)] = entry
        if entry.sha256:
            self._by_digest.setdefault(entry.sha256, entry)
        if entry.weld_id and entry.status == "delivered":
            self._by_weld.setdefault(entry.weld_id, entry)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter(list(self._entries))

    def by_file(self, name: str, size: int, mtime_ns: int) -> LedgerEntry | None:
        """The entry for this exact file (name, size and mtime), if handled."""
        return self._by_file.get((name, size, mtime_ns))

    def by_digest(self, sha256: str) -> LedgerEntry | None:
        """The first entry whose file had these bytes."""
        return self._by_digest.get(sha256)

    def by_weld_id(self, weld_id: str) -> LedgerEntry | None:
        """The entry that delivered this weld id."""
        return self._by_weld.get(weld_id)

    def record(self, entry: LedgerEntry) -> None:
        """Append ``entry`` durably (fsynced) before returning."""
        if entry.status not in STATUSES:
            raise ValueError(f"ledger status {entry.status!r} not in {STATUSES}")
        if self._fd is None:
            raise RuntimeError(f"ledger {self.path} is closed")
        if not entry.at:
            entry = LedgerEntry(**{**asdict(entry), "at": time.time()})
        line = json.dumps(asdict(entry), separators=(",", ":"), sort_keys=True) + "\n"
        os.write(self._fd, line.encode("utf-8"))
        os.fsync(self._fd)
        self._index(entry)

    def compact(self) -> None:
        """Rewrite the file atomically with one line per entry, newest ``max_entries`` kept."""
        latest: dict[tuple[str, int, int], LedgerEntry] = {}
        for entry in self._entries:
            latest[(entry.name, entry.size, entry.mtime_ns)] = entry
        kept = sorted(latest.values(), key=lambda e: e.at)[-self.max_entries :]
        text = "".join(json.dumps(asdict(e), separators=(",", ":"), sort_keys=True) + "\n" for e in kept)
        atomic_write_text(self.path, text)
        self._entries, self._by_file, self._by_digest, self._by_weld = [], {}, {}, {}
        for entry in kept:
            self._index(entry)
        if self._fd is not None:  # the old descriptor points at the replaced inode
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

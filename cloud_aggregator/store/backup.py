"""The store's health: a check before ``serve`` uses it, periodic online backups, and their restore.

A damaged ``aggregator.sqlite`` (pages overwritten on disk, a file cut short) is refused at
start in one line naming the file (:func:`check_store`, SQLite's ``PRAGMA quick_check``),
never used for rounds that would build on it.  While ``serve`` runs, every ``[store]
backup_every`` saved rounds it copies the live database with SQLite's online backup API
(``sqlite3.Connection.backup``) into ``<state_dir>/backups/``, checks the copy (the same
quick check: the periodic one, on the copy, so the live store is not held up) and keeps the
last ``backup_keep``.  ``cloud-aggregator store restore --config aggregator.toml [BACKUP]``
puts the newest (or the named) backup in place; ``serve`` then resumes from the backup's
rounds, losing at most those saved since it was taken.

Artifacts (the global parameters, ``artifacts/<hash>.safetensors``) are never deleted, so a
backup's rows always find theirs; pending uploads kept in the upload log
(``cloud_aggregator.store.upload_log``) may be gone, so a restore drops the rows pointing there and
the devices re-send those uploads (they keep them until the next round).
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BACKUPS = "backups"
PREFIX = "aggregator-"
SUFFIX = ".sqlite"


class StoreDamagedError(ValueError):
    """The store fails SQLite's check (or is no database at all); the message is one line naming it."""


def restore_hint(path: Path) -> str:
    folder = path.parent / BACKUPS
    return (
        f"restore the last good backup ({folder}): cloud-aggregator store restore --config aggregator.toml"
        if any(folder.glob(f"{PREFIX}*{SUFFIX}"))
        else f"no backup in {folder}: move it aside and start afresh (rounds are lost)"
    )


def quick_check(db: sqlite3.Connection) -> str | None:
    """What ``PRAGMA quick_check`` finds wrong (its first line), ``None`` when the database is sound."""
    try:
        rows = db.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        return str(exc)
    first = str(rows[0][0]) if rows else "no answer"
    return None if first == "ok" else first


def check_store(path: Path) -> None:
    """Refuse a store that SQLite finds damaged; a missing one is fine (``serve`` creates it).

    Raises
    ------
    StoreDamagedError
        One line: the file, what SQLite says, how to go on.
    """
    if not path.exists():
        return
    try:
        db = sqlite3.connect(path)
    except sqlite3.DatabaseError as exc:
        raise StoreDamagedError(f"{path} is damaged ({exc}); {restore_hint(path)}") from None
    try:
        why = quick_check(db)
    finally:
        db.close()
    if why is not None:
        raise StoreDamagedError(f"{path} is damaged (quick_check: {why}); {restore_hint(path)}")


@dataclass
class Backups:
    """Online backups of one store: every ``every`` saved rounds, the newest ``keep`` kept.

    ``every = 0`` takes none.  Called by ``SqliteStore.save`` under the store's lock, after
    the round's commit (:meth:`after_save`).
    """

    folder: Path
    every: int = 10
    keep: int = 3
    _saves: int = 0

    def after_save(self, db: sqlite3.Connection, source: Path) -> None:
        """Count a saved round; on every ``every``-th, back the store up (``StoreDamagedError`` if
        the copy fails its check: the live store is damaged, and the older backups are kept)."""
        if self.every <= 0:
            return
        self._saves += 1
        if self._saves % self.every == 0:
            self.take(db, source)

    def take(self, db: sqlite3.Connection, source: Path) -> Path:
        """Copy ``db`` (SQLite's online backup) into a new file here, check it and prune old ones."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        final = self.folder / f"{PREFIX}{stamp}-{time.time_ns() % 10**9:09d}{SUFFIX}"
        tmp = final.with_suffix(".tmp")
        copy = sqlite3.connect(tmp)
        try:
            db.backup(copy)
            why = quick_check(copy)
        finally:
            copy.close()
        if why is not None:
            tmp.unlink(missing_ok=True)
            raise StoreDamagedError(
                f"{source} is damaged (quick_check of its backup: {why}); {restore_hint(source)}"
            )
        os.replace(tmp, final)
        for old in list_backups(self.folder)[: -self.keep] if self.keep > 0 else ():
            old.unlink(missing_ok=True)
        log.info("store backed up to %s", final)
        return final


def list_backups(folder: Path) -> list[Path]:
    """The backups in ``folder``, oldest first (their names sort by time)."""
    return sorted(folder.glob(f"{PREFIX}*{SUFFIX}"))


def backup_rounds(path: Path) -> dict[str, int]:
    """Task -> the round a backup resumes at (its resume points)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {str(t): int(r) for t, r in db.execute("SELECT task, round FROM resume ORDER BY task")}
    finally:
        db.close()


def restore(store: Path, backup: Path | None = None) -> tuple[Path, Path | None]:
    """Put ``backup`` (default: the newest in ``<store's folder>/backups``) in place of ``store``.

    The store (and its WAL) is kept beside as ``aggregator.sqlite.replaced-<time>``.  Returns
    ``(the backup used, where the replaced store went)``.

    Raises
    ------
    StoreDamagedError
        No backup, or the named one fails its check.
    """
    folder = store.parent / BACKUPS
    if backup is None:
        found = list_backups(folder)
        if not found:
            raise StoreDamagedError(
                f"no backup in {folder}: serve takes them every [store] backup_every rounds"
            )
        backup = found[-1]
    if not backup.is_file():
        raise StoreDamagedError(
            f"{backup} is not a file; backups: {', '.join(p.name for p in list_backups(folder)) or 'none'}"
        )
    check_store(backup)
    kept = None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    for suffix in ("", "-wal", "-shm"):
        part = store.with_name(store.name + suffix)
        if part.exists():
            aside = store.with_name(f"{store.name}.replaced-{stamp}{suffix}")
            os.replace(part, aside)
            kept = kept or aside
    tmp = store.with_name(store.name + ".restoring")
    shutil.copyfile(backup, tmp)
    db = sqlite3.connect(tmp)
    try:
        # Rows pointing into the upload log may name files dropped since: the devices re-send.
        if "log_at" in {r[1] for r in db.execute("PRAGMA table_info(updates)")}:
            db.execute("DELETE FROM updates WHERE log_at IS NOT NULL")
            db.commit()
    finally:
        db.close()
    os.replace(tmp, store)
    return backup, kept

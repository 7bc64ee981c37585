"""The store's SQLite schema, and bringing a store an older version wrote up to it."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

from cloud_aggregator.rounds.types import Reason, RoundRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    name TEXT PRIMARY KEY, spec TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
    task TEXT NOT NULL, round INTEGER NOT NULL, phase TEXT NOT NULL, status TEXT NOT NULL,
    participants TEXT NOT NULL, n_samples TEXT NOT NULL, metrics TEXT NOT NULL,
    rejected TEXT NOT NULL, global_hash TEXT NOT NULL, started REAL NOT NULL, finished REAL NOT NULL,
    extra TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (task, round, phase)
);
CREATE TABLE IF NOT EXISTS resume (
    task TEXT PRIMARY KEY, round INTEGER NOT NULL, phase_index INTEGER NOT NULL,
    global_hash TEXT NOT NULL, strategy_state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS updates (
    task TEXT NOT NULL, round INTEGER NOT NULL, phase TEXT NOT NULL, device TEXT NOT NULL,
    global_hash TEXT NOT NULL, payload BLOB NOT NULL, received REAL NOT NULL,
    PRIMARY KEY (task, round, phase, device)
);
CREATE TABLE IF NOT EXISTS partials (
    task TEXT NOT NULL, round INTEGER NOT NULL, phase TEXT NOT NULL, global_hash TEXT NOT NULL,
    state BLOB NOT NULL, updated REAL NOT NULL, PRIMARY KEY (task, round, phase)
);
CREATE TABLE IF NOT EXISTS folded (
    task TEXT NOT NULL, round INTEGER NOT NULL, phase TEXT NOT NULL, device TEXT NOT NULL,
    n_samples INTEGER NOT NULL, metrics TEXT NOT NULL, PRIMARY KEY (task, round, phase, device)
);
CREATE TABLE IF NOT EXISTS rejections (
    task TEXT NOT NULL, round INTEGER, device TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
    code TEXT NOT NULL DEFAULT 'other'
);
CREATE TABLE IF NOT EXISTS rollouts (
    model TEXT NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL, record TEXT NOT NULL,
    updated REAL NOT NULL, PRIMARY KEY (model, version)
);
"""

#: Codes of stores written before ``admission.Reason``: a duplicate upload is a replay now.
_LEGACY_CODES = {"duplicate": Reason.REPLAY}


def legacy_code(text: str) -> tuple[Reason, str]:
    """``(code, detail)`` of a rejection stored as ``"<code>: <detail>"`` text; ``other`` if it names none."""
    head, sep, detail = text.partition(":")
    if not sep:
        return Reason.OTHER, text
    try:
        code = _LEGACY_CODES.get(head) or Reason(head)
    except ValueError:
        return Reason.OTHER, text
    return code, detail.strip()


def has_reason_codes(db: sqlite3.Connection) -> bool:
    """Whether the ``rejections`` table has its ``code`` column (a store written since codes got one)."""
    return "code" in {r[1] for r in db.execute("PRAGMA table_info(rejections)")}


def migrate(db: sqlite3.Connection) -> None:
    """Create the tables a store lacks and give a store an older version wrote the columns it lacks."""
    db.executescript(SCHEMA)
    columns = {r[1] for r in db.execute("PRAGMA table_info(rounds)")}
    if "extra" not in columns:  # a store written before round records had extras
        db.execute("ALTER TABLE rounds ADD COLUMN extra TEXT NOT NULL DEFAULT '{}'")
    columns = {r[1] for r in db.execute("PRAGMA table_info(updates)")}
    if "log_at" not in columns:  # a store written before large payloads went to the upload log
        db.execute("ALTER TABLE updates ADD COLUMN log_at INTEGER")
        db.execute("ALTER TABLE updates ADD COLUMN log_len INTEGER")
    if not has_reason_codes(db):
        _migrate_reason_codes(db)


def _migrate_reason_codes(db: sqlite3.Connection) -> None:
    """Give rejections stored as ``"<code>: <detail>"`` text their code column (parsed once, here)."""
    db.execute("BEGIN IMMEDIATE")
    db.execute("ALTER TABLE rejections ADD COLUMN code TEXT NOT NULL DEFAULT 'other'")
    rows = db.execute("SELECT rowid, reason FROM rejections").fetchall()
    for rowid, text in rows:
        code, detail = legacy_code(text)
        db.execute("UPDATE rejections SET code=?, reason=? WHERE rowid=?", (str(code), detail, rowid))
    db.execute("COMMIT")


#: The ``rounds`` table's columns, in :func:`round_row`'s order.
ROUND_COLUMNS = "task, round, phase, status, participants, n_samples, metrics, rejected, global_hash, started, finished, extra"


def round_row(record: RoundRecord) -> tuple:
    """``record`` as a ``rounds`` row (its lists and dicts as JSON)."""
    r = record
    return (r.task, r.round, r.phase, r.status, json.dumps(r.participants), json.dumps(r.n_samples),
            json.dumps(r.metrics), json.dumps(r.rejected), r.global_hash, r.started, r.finished,
            json.dumps(r.extra, sort_keys=True))  # fmt: skip


def round_record(row: Sequence) -> RoundRecord:
    """A ``rounds`` row (:data:`ROUND_COLUMNS`) read back as a :class:`RoundRecord`."""
    return RoundRecord(
        task=row[0], round=row[1], phase=row[2], status=row[3], participants=json.loads(row[4]),
        n_samples=json.loads(row[5]), metrics=json.loads(row[6]), rejected=json.loads(row[7]),
        global_hash=row[8], started=row[9], finished=row[10], extra=json.loads(row[11]),
    )  # fmt: skip

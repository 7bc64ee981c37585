"""The aggregator's durable state: SQLite (WAL) for rounds, updates and resume points;
global parameters as content-addressed artifact files.

Order of writes makes a crash at any instant safe: an artifact is written
atomically under its hash before the transaction that points at it commits, and
a round's record and its resume point commit in one transaction.  Received
updates are stored as they arrive (idempotently, keyed by task, round, phase and
device), so a restarted aggregator loses none and counts none twice: it reads
them back for the round it resumes, and a device's re-send of a stored one is a
duplicate.  A streaming round (``cloud_aggregator.aggregation.streaming``) checkpoints its partial sum
every so many uploads and drops the payloads it covers, so the disk holds O(P) plus the
uploads since the last checkpoint, not O(N × P).  Payloads of 1 kB and more are appended to
plain files beside the database (``cloud_aggregator.store.upload_log``), their rows pointing at them.  Refused uploads are kept with their
reason code (``admission.Reason``) in a column of its own (the tables: :mod:`.schema`).  ``cloud_aggregator.faults`` points mark each step for kill tests.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cloud_aggregator import faults
from cloud_aggregator.rounds.types import Reason, RoundRecord, StoredRefusal, StoredUpload
from cloud_aggregator.store.backup import Backups
from cloud_aggregator.store.schema import ROUND_COLUMNS, has_reason_codes, migrate, round_record, round_row
from cloud_aggregator.store.task_history import TaskChangedError, TaskHistory, changed_fields
from cloud_aggregator.store.upload_log import MIN_BYTES, UploadLog
from ioft_protocol.state import atomic_write_bytes, decode_arrays, encode_arrays
from trainer_lite.params import Params, param_hash

__all__ = ["SqliteStore", "TaskChangedError", "TaskHistory", "changed_fields"]


#: ``json.dumps(obj, sort_keys=True)`` without building an encoder per call (one per folded upload).
_sorted_json = json.JSONEncoder(sort_keys=True).encode
#: An ``updates`` row's columns, in :meth:`SqliteStore._update_row`'s order.
_UPDATE_COLUMNS = (
    "(task, round, phase, device, global_hash, payload, received, log_at, log_len) VALUES (?,?,?,?,?,?,?,?,?)"
)


class SqliteStore:
    """A ``RoundStore`` in one SQLite file plus an ``artifacts/`` folder beside it."""

    def __init__(self, path: str | Path, *, readonly: bool = False, backups: Backups | None = None) -> None:
        """Open (creating if needed) the store; ``readonly`` opens an existing one for
        monitoring without taking any write lock, so it never slows the aggregator down;
        ``backups``: take online backups as rounds are saved (``cloud_aggregator.store.backup``)."""
        self.path = Path(path)
        self.backups = backups
        self.artifacts = self.path.parent / "artifacts"
        self.uploads = UploadLog(self.path.parent / "uploads")
        #: A fault plan kills at the n-th stored upload: :meth:`put_batch` then commits each alone.
        self._uploads_one_by_one = faults.armed("after_store_update")
        self._lock = threading.Lock()
        self.readonly = readonly
        if readonly:
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a killed process loses nothing; a power cut may lose the last commits, which
        # devices re-send (they cache their upload until the next round).
        self._db.execute("PRAGMA synchronous=NORMAL")
        migrate(self._db)

    def _has_reason_codes(self) -> bool:
        with self._lock:
            return has_reason_codes(self._db)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self.uploads.close()

    # -- artifacts ---------------------------------------------------------
    def put_params(self, params: Params) -> str:
        digest = param_hash(params)
        path = self.artifacts / f"{digest}.safetensors"
        if not path.exists():
            atomic_write_bytes(path, encode_arrays(params))
        return digest

    def get_params(self, digest: str) -> Params:
        arrays, _ = decode_arrays((self.artifacts / f"{digest}.safetensors").read_bytes())
        if param_hash(arrays) != digest:
            raise ValueError(f"artifact {digest} does not match its name")
        return arrays

    # -- tasks ---------------------------------------------------------------
    def task_spec(self, name: str) -> str | None:
        """The stored spec JSON of ``name``; ``None`` for a task the store has not seen."""
        with self._lock:
            row = self._db.execute("SELECT spec FROM tasks WHERE name=?", (name,)).fetchone()
        return None if row is None else row[0]

    def history(self, name: str) -> TaskHistory:
        """How many rounds, pending uploads and refusals of ``name`` are stored."""
        with self._lock:
            rounds, last = self._db.execute(
                "SELECT COUNT(*), COALESCE(MAX(round), 0) FROM rounds WHERE task=?", (name,)
            ).fetchone()
            updates = self._db.execute("SELECT COUNT(*) FROM updates WHERE task=?", (name,)).fetchone()[0]
            refused = self._db.execute("SELECT COUNT(*) FROM rejections WHERE task=?", (name,)).fetchone()[0]
        return TaskHistory(int(rounds), int(last), int(updates), int(refused))

    def check_task(self, name: str, spec_json: str) -> None:
        """Raise :class:`TaskChangedError` unless ``spec_json`` can resume ``name``'s stored history."""
        stored = self.task_spec(name)
        if stored is None or stored == spec_json:
            return
        history = self.history(name)
        fields = changed_fields(stored, spec_json, history.last_round)
        if fields:
            raise TaskChangedError(name, fields, history)

    def register_task(self, name: str, spec_json: str, *, restart: bool = False) -> bool:
        """Record the task's spec; returns ``True`` when it resumes stored history.

        ``restart`` deletes the task's rounds, resume point, pending uploads and refusals
        first.  Otherwise a spec that differs from the stored one only in
        :data:`trainer_lite.task.SCHEDULE_FIELDS` (more ``rounds``) replaces it and keeps the history, and any
        other difference raises :class:`TaskChangedError` and changes nothing.
        """
        if not restart:
            self.check_task(name, spec_json)
        with self._lock:
            row = self._db.execute("SELECT spec FROM tasks WHERE name=?", (name,)).fetchone()
            if row is not None and row[0] == spec_json and not restart:
                return True
            self._db.execute("BEGIN IMMEDIATE")
            if restart:
                for table in ("rounds", "resume", "updates", "rejections", "partials", "folded"):
                    self._db.execute(f"DELETE FROM {table} WHERE task=?", (name,))
            self._db.execute(
                "INSERT OR REPLACE INTO tasks (name, spec, created) VALUES (?, ?, ?)",
                (name, spec_json, time.time()),
            )
            self._db.execute("COMMIT")
            if restart:
                self.uploads.drop(name)
            return row is not None and not restart

    def next_round(self, name: str) -> int:
        """The round ``name`` resumes at (1 for a task with no resume point)."""
        with self._lock:
            row = self._db.execute("SELECT round FROM resume WHERE task=?", (name,)).fetchone()
        return 1 if row is None else int(row[0])

    # -- RoundStore ------------------------------------------------------------
    def resume_point(self, task: str) -> tuple[int, int, Params, dict[str, Any]] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT round, phase_index, global_hash, strategy_state FROM resume WHERE task=?", (task,)
            ).fetchone()
        if row is None:
            return None
        return row[0], row[1], self.get_params(row[2]), json.loads(row[3])

    def save(
        self, record: RoundRecord, next_point: tuple[int, int], global_params: Params, state: dict
    ) -> None:
        digest = self.put_params(global_params)
        faults.point("after_artifact")
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT OR REPLACE INTO rounds VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", round_row(record)
            )
            self._db.execute(
                "INSERT OR REPLACE INTO resume VALUES (?,?,?,?,?)",
                (record.task, next_point[0], next_point[1], digest, json.dumps(state, sort_keys=True)),
            )
            # Earlier rounds' leftovers go too: stragglers stored for a round already closed.
            for table in ("updates", "partials", "folded"):
                self._db.execute(
                    f"DELETE FROM {table} WHERE task=? AND (round<? OR (round=? AND phase=?))",
                    (record.task, record.round, record.round, record.phase),
                )
            faults.point("before_commit")
            self._db.execute("COMMIT")
            self.uploads.drop(record.task, (record.round, record.phase))
            if self.backups is not None:  # under the lock: the copy is of committed rounds only
                self.backups.after_save(self._db, self.path)

    # -- updates as they arrive ----------------------------------------------------
    def put_update(
        self, task: str, round_: int, phase: str, device: str, global_hash: str, payload: bytes
    ) -> bool:
        """Store a received update; ``False`` if one from that device is already stored.

        A payload of ``MIN_BYTES`` or more goes to the upload log first; the row points at it.
        """
        with self._lock:
            row = self._update_row(task, round_, phase, device, global_hash, payload, time.time())
            cur = self._db.execute(f"INSERT OR IGNORE INTO updates {_UPDATE_COLUMNS}", row)
        faults.point("after_store_update")
        return cur.rowcount == 1

    def put_batch(self, updates: Sequence[StoredUpload], rejections: Sequence[StoredRefusal]) -> None:
        """Store a drained batch's admitted uploads (as :meth:`put_update`) and refusals (as
        :meth:`put_rejection`) in one transaction: one commit, not one per upload.

        ``after_store_update`` passes once per upload, after the commit.  While a fault plan names
        that point, each upload commits on its own, so a planned kill lands between two uploads
        as the plan counts them.
        """
        if self._uploads_one_by_one:
            for row in updates:
                self.put_update(*row)
            updates = ()
        if not updates and not rejections:
            return
        now = time.time()
        with self._lock:
            rows = self._update_rows(updates, now)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(f"INSERT OR IGNORE INTO updates {_UPDATE_COLUMNS}", rows)
                self._db.executemany(
                    "INSERT INTO rejections (task, round, device, reason, at, code) VALUES (?,?,?,?,?,?)",
                    [(t, r, d, detail[:500], now, str(why)) for t, r, d, why, detail in rejections],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        if updates:
            faults.point("after_store_update", passes=len(updates))

    def _update_row(
        self, task: str, round_: int, phase: str, device: str, global_hash: str, payload: bytes, now: float
    ) -> tuple:
        """An ``updates`` row; a payload of ``MIN_BYTES`` or more goes to the upload log, the row
        pointing at it (the caller holds the lock)."""
        at = self.uploads.append(task, round_, phase, payload) if len(payload) >= MIN_BYTES else None
        kept = b"" if at is not None else payload
        return (task, round_, phase, device, global_hash, kept, now, at, None if at is None else len(payload))

    def _update_rows(self, updates: Sequence[StoredUpload], now: float) -> list[tuple]:
        """:meth:`_update_row` of each of ``updates``, the payloads of a round's file appended to the
        upload log together (one system call per batch, not two per upload)."""
        logged: dict[tuple[str, int, str], list[int]] = {}  # (task, round, phase) -> indexes into updates
        for i, u in enumerate(updates):
            if len(u[5]) >= MIN_BYTES:
                logged.setdefault((u[0], u[1], u[2]), []).append(i)
        at: dict[int, int] = {}
        for key, indexes in logged.items():
            offsets = self.uploads.append_many(*key, [updates[i][5] for i in indexes])
            at.update(zip(indexes, offsets, strict=True))
        rows = []
        for i, (task, round_, phase, device, global_hash, payload) in enumerate(updates):
            offset = at.get(i)
            if offset is None:
                rows.append((task, round_, phase, device, global_hash, payload, now, None, None))
            else:
                rows.append((task, round_, phase, device, global_hash, b"", now, offset, len(payload)))
        return rows

    def stored_updates(self, task: str, round_: int, phase: str, global_hash: str) -> list[tuple[str, bytes]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT device, payload, log_at, log_len FROM updates "
                "WHERE task=? AND round=? AND phase=? AND global_hash=? "
                "ORDER BY rowid",  # arrival order: a fold restored from them sums in the same order
                (task, round_, phase, global_hash),
            ).fetchall()
            out = []
            for device, payload, at, length in rows:
                if at is not None:
                    payload = self.uploads.read(task, round_, phase, at, length)
                    if payload is None:
                        continue  # the device re-sends it when the round is announced again
                out.append((device, bytes(payload)))
        return out

    # -- checkpoints of a streaming round's partial sum (cloud_aggregator.aggregation.streaming) ----------
    def put_partial(
        self,
        task: str,
        round_: int,
        phase: str,
        global_hash: str,
        state: bytes,
        folded: dict[str, tuple[int, dict[str, float]]],
    ) -> None:
        """In one transaction: the round's partial sum replaces the last one, the devices folded
        since then are noted with their sample counts and metrics, and their stored payloads go."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT OR REPLACE INTO partials VALUES (?,?,?,?,?,?)",
                (task, round_, phase, global_hash, state, time.time()),
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO folded VALUES (?,?,?,?,?,?)",
                [(task, round_, phase, d, n, _sorted_json(m)) for d, (n, m) in folded.items()],
            )
            self._db.executemany(
                "DELETE FROM updates WHERE task=? AND round=? AND phase=? AND device=?",
                [(task, round_, phase, d) for d in folded],
            )
            self._db.execute("COMMIT")
            logged = self._db.execute(
                "SELECT COUNT(*) FROM updates WHERE task=? AND round=? AND phase=? AND log_at IS NOT NULL",
                (task, round_, phase),
            ).fetchone()[0]
            if not logged:  # every logged upload of the round is in the checkpoint
                self.uploads.empty(task, round_, phase)

    def partial(
        self, task: str, round_: int, phase: str, global_hash: str
    ) -> tuple[bytes, dict[str, tuple[int, dict[str, float]]]] | None:
        """The last checkpointed partial sum of a round and who is folded in it, or ``None``."""
        with self._lock:
            row = self._db.execute(
                "SELECT state FROM partials WHERE task=? AND round=? AND phase=? AND global_hash=?",
                (task, round_, phase, global_hash),
            ).fetchone()
            if row is None:
                return None
            rows = self._db.execute(
                "SELECT device, n_samples, metrics FROM folded WHERE task=? AND round=? AND phase=?",
                (task, round_, phase),
            ).fetchall()
        return bytes(row[0]), {d: (int(n), json.loads(m)) for d, n, m in rows}

    def put_rejection(self, task: str, round_: int | None, device: str, reason: Reason, detail: str) -> None:
        """Record a refused upload: its code in ``code``, what was wrong in ``reason``."""
        with self._lock:
            self._db.execute(
                "INSERT INTO rejections (task, round, device, reason, at, code) VALUES (?,?,?,?,?,?)",
                (task, round_, device, detail[:500], time.time(), str(reason)),
            )

    # -- reading back -------------------------------------------------------------
    def rounds(self, task: str) -> list[RoundRecord]:
        if self.readonly and not self._has_schema():
            return []  # the aggregator has not created its tables yet
        with self._lock:
            rows = self._db.execute(
                f"SELECT {ROUND_COLUMNS} FROM rounds WHERE task=? ORDER BY round, started", (task,)
            ).fetchall()
        return [round_record(r) for r in rows]

    def round_count(self, task: str) -> int:
        """How many rounds of ``task`` are recorded (cheap: for monitors that poll)."""
        if self.readonly and not self._has_schema():
            return 0
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM rounds WHERE task=?", (task,)).fetchone()[0])

    def _has_schema(self) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='rounds'"
            ).fetchone()
        return row is not None

    def rejection_counts(self, task: str | None = None) -> dict[str, int]:
        """``{device: refusals}`` (of ``task``, or of all tasks and of no round)."""
        return {d: sum(per.values()) for d, per in self.rejection_counts_by_reason(task).items()}

    def rejection_counts_by_reason(self, task: str | None = None) -> dict[str, dict[str, int]]:
        """``{device: {reason code: refusals}}`` (of ``task``, or of all tasks and of no round).

        A read-only view of a store no aggregator has opened since codes got their column
        counts its rejections as ``other``.
        """
        if self.readonly and not self._has_schema():
            return {}
        code = "code" if not self.readonly or self._has_reason_codes() else "'other'"
        query = f"SELECT device, {code}, COUNT(*) FROM rejections"
        args: tuple = ()
        if task is not None:
            query += " WHERE task=?"
            args = (task,)
        with self._lock:
            rows = self._db.execute(query + " GROUP BY device, 2", args).fetchall()
        out: dict[str, dict[str, int]] = {}
        for device, reason, n in rows:
            out.setdefault(device, {})[reason] = n
        return out

    def tasks(self) -> dict[str, str]:
        with self._lock:
            return dict(self._db.execute("SELECT name, spec FROM tasks").fetchall())

    # -- staged model rollouts (cloud_aggregator.models.rollout owns the record's JSON) --------
    def put_rollout(self, model: str, version: int, state: str, record_json: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO rollouts VALUES (?, ?, ?, ?, ?)",
                (model, version, state, record_json, time.time()),
            )

    def rollouts(self, model: str | None = None) -> list[str]:
        """Stored rollout records (JSON), oldest first; of ``model`` only when given."""
        if self.readonly and not self._has_table("rollouts"):
            return []
        query, args = "SELECT record FROM rollouts", ()
        if model is not None:
            query, args = query + " WHERE model=?", (model,)
        with self._lock:
            return [r[0] for r in self._db.execute(query + " ORDER BY updated, model, version", args)]

    def _has_table(self, name: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,))
            return row.fetchone() is not None

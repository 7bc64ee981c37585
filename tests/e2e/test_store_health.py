"""A damaged ``aggregator.sqlite`` is refused, and a backup brings ``serve`` back.

Before: ``serve`` ran hundreds of rounds on a store with three overwritten pages (``PRAGMA
integrity_check``: malformed), and one cut to half its size ended in an uncaught
``sqlite3.DatabaseError`` traceback; nothing took backups.  Real ``serve`` and
``edge-trainer`` processes on a real mosquitto.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml, pflda_task
from cloud_aggregator.rounds.types import RoundRecord
from cloud_aggregator.store.backup import Backups, StoreDamagedError, list_backups
from cloud_aggregator.store.sqlite import SqliteStore

DEVICES = ["printer1", "printer2"]
PAGE = 4096


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cloud_aggregator.cli", *args], capture_output=True, text=True, timeout=60
    )


def _a_store(path: Path, rounds: int = 60) -> None:
    """A store with ``rounds`` saved rounds (pages enough to damage some), written as serve writes it."""
    store = SqliteStore(path)
    store.register_task("speed", "{}")
    for r in range(1, rounds + 1):
        rec = RoundRecord(
            "speed", r, "train", "ok", [f"d{i}" for i in range(20)], {}, {}, [], "h" * 64, 0.0, 1.0
        )
        store.save(rec, (r + 1, 0), {"w": np.zeros(4, "float32")}, {"r": r})
    store.close()


def _refused_in_one_line(config: Path, db: Path) -> str:
    out = _cli("serve", "--config", str(config))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(db) in lines[0] and "damaged" in lines[0], out.stderr
    return lines[0]


def test_overwritten_pages_and_a_truncated_store_are_refused_in_one_line(tmp_path):
    state = tmp_path / "aggregator"
    state.mkdir()
    db = state / "aggregator.sqlite"
    config = tmp_path / "aggregator.toml"
    config.write_text(aggregator_toml("mqtt://127.0.0.1:1", state, [pflda_task()], startup_wait_s=1))
    _a_store(db)
    size = db.stat().st_size
    assert size >= 6 * PAGE
    good = db.read_bytes()

    # Three pages overwritten (a bad disk, a stray write): refused before anything connects.
    with db.open("r+b") as f:
        for page in (2, 3, 4):
            f.seek(page * PAGE)
            f.write(os.urandom(PAGE))
    assert "no backup" in _refused_in_one_line(config, db)

    # Cut to half.
    db.write_bytes(good[: size // 2])
    _refused_in_one_line(config, db)


@pytest.mark.broker
def test_a_backup_restored_with_one_command_resumes_serve_from_its_round(fleet_procs: LocalFleet):
    state = fleet_procs.work / "aggregator"
    toml = aggregator_toml(
        fleet_procs.broker_url,
        state,
        [pflda_task(rounds=5)],
        expected=DEVICES,
        settings={"store": {"backup_every": 2, "backup_keep": 1}},
    )
    fleet_procs.start_devices(DEVICES)
    fleet_procs.start_aggregator(toml)
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    assert [r.round for r in fleet_procs.rounds()] == [1, 2, 3, 4, 5]
    backups = list_backups(state / "backups")
    assert len(backups) == 1  # taken after rounds 2 and 4, the newest kept

    # The store is damaged: serve refuses it and names the way back.
    db = fleet_procs.db
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])
    config = fleet_procs.work / "aggregator.toml"
    assert "store restore" in _refused_in_one_line(config, db)

    out = _cli("store", "restore", "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert "speed resumes at round 5" in out.stdout, out.stdout

    before = fleet_procs.log("aggregator")
    fleet_procs.start_aggregator(toml)
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    assert "resumes at round 5" in fleet_procs.log("aggregator")[len(before) :]
    assert [r.round for r in fleet_procs.rounds()] == [1, 2, 3, 4, 5]  # round 5 ran again


def test_the_periodic_check_refuses_a_store_damaged_while_serving_and_keeps_the_older_backups(tmp_path):
    db = tmp_path / "aggregator.sqlite"
    _a_store(db)
    backups = Backups(tmp_path / "backups", every=1, keep=2)
    live = sqlite3.connect(db)
    try:
        good = backups.take(live, db)
    finally:
        live.close()
    with db.open("r+b") as f:  # damaged on disk after start-up
        for page in (2, 3, 4):
            f.seek(page * PAGE)
            f.write(os.urandom(PAGE))
    live = sqlite3.connect(db)
    try:
        with pytest.raises(StoreDamagedError, match=str(db)):
            backups.after_save(live, db)
    finally:
        live.close()
    assert list_backups(tmp_path / "backups") == [good]  # no damaged copy among them

"""`cloud-aggregator serve` as an operator runs it: edits of a task between runs, `--restart TASK`,
and `serve --service` (SIGHUP takes new or extended tasks, SIGTERM exits 0), with mosquitto and
real `edge-trainer` processes."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_aggregator import faults
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml, pflda_task

DEVICES = ["printer1", "printer2"]


def _toml(fleet: LocalFleet, *tasks: dict[str, object]) -> str:
    return aggregator_toml(fleet.broker_url, fleet.work / "aggregator", list(tasks), expected=DEVICES)


def _whole_line(fleet: LocalFleet, needle: str) -> str:
    """The first finished line of the aggregator's log holding ``needle`` (``""``: none yet); the
    last line may still be being written."""
    text = fleet.log("aggregator")
    return next((ln for ln in text[: text.rfind("\n") + 1].splitlines() if needle in ln), "")


def _serve(fleet: LocalFleet, toml: str, *args: str) -> subprocess.Popen:
    """``serve --config`` with extra ``args``, as :attr:`LocalFleet.aggregator` (log: aggregator.log)."""
    cfg = fleet.work / "aggregator.toml"
    cfg.write_text(toml)
    with (fleet.work / "aggregator.log").open("ab") as log:
        fleet.aggregator = subprocess.Popen(
            [sys.executable, "-m", "cloud_aggregator.cli", "serve", "--config", str(cfg), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**faults.child_env(None), "PYTHONUNBUFFERED": "1"},
        )
    return fleet.aggregator


def _dump(db: Path) -> list[str]:
    con = sqlite3.connect(db)
    try:
        return list(con.iterdump())
    finally:
        con.close()


def _new_log(fleet: LocalFleet, before: str) -> str:
    return fleet.log("aggregator")[len(before) :]


@pytest.mark.broker
def test_editing_a_task_keeps_history_refuses_other_changes_and_restart_starts_afresh(fleet_procs):
    fleet_procs.start_devices(DEVICES)
    fleet_procs.start_aggregator(_toml(fleet_procs, pflda_task(rounds=3)))
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    first = fleet_procs.rounds()
    assert [r.round for r in first] == [1, 2, 3]

    # More rounds (and another deadline) resume at round 4 with the history kept.
    before = fleet_procs.log("aggregator")
    extended = aggregator_toml(
        fleet_procs.broker_url,
        fleet_procs.work / "aggregator",
        [pflda_task(rounds=5)],
        expected=DEVICES,
        deadline_s=7,
    )
    fleet_procs.start_aggregator(extended)
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    records = fleet_procs.rounds()
    assert [r.round for r in records] == [1, 2, 3, 4, 5]
    assert [(r.global_hash, r.started) for r in records[:3]] == [(r.global_hash, r.started) for r in first]
    assert "resumes at round 4" in _new_log(fleet_procs, before)

    # Another algorithm, and a mistyped one: one line each, exit 2, the store untouched.
    stored = _dump(fleet_procs.db)
    for algorithm, says in (("fedavg", "algorithm changed"), ("pfl-da", "unknown algorithm 'pfl-da'")):
        before = fleet_procs.log("aggregator")
        fleet_procs.start_aggregator(_toml(fleet_procs, pflda_task(rounds=5) | {"algorithm": algorithm}))
        assert fleet_procs.wait_aggregator(60) == 2
        out = _new_log(fleet_procs, before)
        assert says in out and "Traceback" not in out, out
        assert _dump(fleet_procs.db) == stored
    assert "--restart speed" in out or "fedavg" in out  # the way forward is named
    changed = _new_log(fleet_procs, "")
    assert "cloud-aggregator serve --restart speed" in changed

    # `--restart speed`: says what it deletes, then starts that task afresh.
    before = fleet_procs.log("aggregator")
    _serve(fleet_procs, _toml(fleet_procs, pflda_task(rounds=2) | {"seed": 7}), "--restart", "speed")
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    out = _new_log(fleet_procs, before)
    assert "deleting 5 round records (1-5)" in out, out
    assert [r.round for r in fleet_procs.rounds()] == [1, 2]
    assert fleet_procs.rounds()[0].started > records[-1].finished


@pytest.mark.broker
def test_service_takes_tasks_on_sighup_refuses_bad_edits_and_exits_0_on_sigterm(fleet_procs):
    fleet_procs.start_devices(DEVICES)
    proc = _serve(fleet_procs, _toml(fleet_procs, pflda_task(rounds=2)), "--service")
    fleet_procs.wait_for(
        lambda: "waiting for new or extended tasks" in fleet_procs.log("aggregator"), 120, "idle"
    )
    assert proc.poll() is None  # its tasks are done; a service stays up

    # A bad edit is refused in one line; the service goes on.
    cfg = fleet_procs.work / "aggregator.toml"
    cfg.write_text(_toml(fleet_procs, pflda_task(rounds=2) | {"model": "linear"}))
    proc.send_signal(signal.SIGHUP)
    fleet_procs.wait_for(lambda: _whole_line(fleet_procs, "SIGHUP: config refused"), 60, "the refusal")
    refusal = _whole_line(fleet_procs, "SIGHUP: config refused")
    assert "model changed" in refusal and "--restart speed" in refusal
    assert proc.poll() is None

    # A new task and an extended one are taken on SIGHUP.
    cfg.write_text(_toml(fleet_procs, pflda_task(rounds=3), pflda_task("speed2", seed=3, rounds=2)))
    proc.send_signal(signal.SIGHUP)
    fleet_procs.wait_for(
        lambda: len(fleet_procs.rounds("speed")) == 3 and len(fleet_procs.rounds("speed2")) == 2,
        120,
        "new rounds",
    )
    fleet_procs.wait_for(
        lambda: fleet_procs.log("aggregator").count("waiting for new or extended tasks") >= 2,
        60,
        "idle again",
    )

    # SIGTERM: exit 0, and the next start resumes (nothing left to run: it says so and exits 0).
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, fleet_procs.log("aggregator")
    _serve(fleet_procs, cfg.read_text())
    assert fleet_procs.wait_aggregator(60) == 0, fleet_procs.log("aggregator")
    assert [r.round for r in fleet_procs.rounds("speed")] == [1, 2, 3]

    # Normal events (clean disconnects, a device re-sending an upload) log no warning.
    log = fleet_procs.log("aggregator")
    assert "WARNING" not in log, log
    assert "Traceback" not in log


@pytest.mark.broker
def test_sigterm_mid_round_exits_0_and_the_restart_logs_no_warning(fleet_procs):
    fleet_procs.start_devices(DEVICES)
    task = pflda_task(rounds=4)
    # One device is awaited that never comes: round 1 waits out its deadline, uploads stored.
    toml = aggregator_toml(
        fleet_procs.broker_url,
        fleet_procs.work / "aggregator",
        [task],
        expected=[*DEVICES, "printer9"],
        deadline_s=30,
        startup_wait_s=1,
    )
    proc = _serve(fleet_procs, toml)
    db = fleet_procs.db

    def uploads_stored() -> bool:
        if not db.exists():
            return False
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return con.execute("SELECT COUNT(*) FROM updates").fetchone()[0] == len(DEVICES)
        except sqlite3.OperationalError:
            return False
        finally:
            con.close()

    fleet_procs.wait_for(uploads_stored, 120, "both uploads of round 1 stored")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, fleet_procs.log("aggregator")

    # Restarted: round 1 is re-announced, both devices re-send their upload: normal, no warning.
    fleet_procs.start_aggregator(_toml(fleet_procs, task))
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    assert [r.round for r in fleet_procs.rounds()] == [1, 2, 3, 4]
    log = fleet_procs.log("aggregator")
    assert "restored from the store" in log
    assert "WARNING" not in log and "Traceback" not in log, log
    fleet_procs.stop_all()
    for d in DEVICES:
        device_log = fleet_procs.log(d)
        assert "WARNING" not in device_log, device_log
        # one INFO line per round: task, round, a metric and seconds
        assert device_log.count("task speed round ") == 4, device_log

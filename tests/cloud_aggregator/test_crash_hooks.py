"""Fault-hook syntax, straggler arithmetic and the store's crash-safe bookkeeping (no broker)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cloud_aggregator import faults
from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.stragglers import absorb_late, damp_late
from cloud_aggregator.rounds.task_rules import check_next_round
from cloud_aggregator.rounds.types import LateUpdate, LateWindow, RoundRecord
from cloud_aggregator.store.sqlite import SqliteStore
from trainer_lite.task import TaskSpec

SPEC = TaskSpec("speed", "pflda", "sigmoid_glm", server={"weighting": "uniform"}, rounds=3)


def test_fault_spec_parses_and_names_the_valid_points():
    assert faults.parse(None) is None and faults.parse("") is None
    assert faults.parse("after_save:2:stop,after_save:3,before_commit:1") == {
        "after_save": {2: "stop", 3: "kill"},
        "before_commit": {1: "kill"},
    }
    for bad in ("after_sav:1", "after_save:0", "after_save", "after_save:1:explode"):
        with pytest.raises(ValueError, match="IOFT_FAULT"):
            faults.parse(bad)


def test_fault_point_kills_on_the_named_pass_only():
    code = "from cloud_aggregator import faults\nfor i in range(5):\n    print(i, flush=True)\n    faults.point('after_save')\n"
    env = {"IOFT_FAULT": "after_save:3", "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9 and proc.stdout.split() == ["0", "1", "2"]
    unset = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert unset.returncode == 0 and unset.stdout.split() == ["0", "1", "2", "3", "4"]


# A round loop's thread hits the point while the main thread sleeps at low priority on the same
# CPU: the worst case for a process-wide SIGSTOP, which only the main thread took, when it ran.
STOPPED_THREAD = """
import os, sys, threading
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from cloud_aggregator import faults
go = threading.Event()
def loop():
    go.wait()
    faults.point("after_save")
    for i in range(100_000):
        sys.stdout.write(f"went on {i}\\n")
worker = threading.Thread(target=loop)
worker.start()
os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
go.set()
worker.join()
"""


def _all_threads_stopped(pid: int) -> bool:
    states = [p.read_text().rsplit(")", 1)[1].split()[0] for p in Path(f"/proc/{pid}/task").glob("*/stat")]
    return bool(states) and all(s == "T" for s in states)


def test_a_stop_point_stops_the_thread_that_hits_it_there(tmp_path):
    env = {**os.environ, "IOFT_FAULT": "after_save:1:stop", "PYTHONUNBUFFERED": "1"}
    for attempt in range(3):  # before the fix, each went on past the point about 8 times in 10
        out = tmp_path / f"out{attempt}.txt"
        with out.open("w") as fh:
            proc = subprocess.Popen([sys.executable, "-c", STOPPED_THREAD], env=env, stdout=fh, stderr=fh)
        try:
            deadline = time.monotonic() + 60  # only guards the suite against a hang
            while not _all_threads_stopped(proc.pid):
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-500:]
                time.sleep(0.01)
        finally:
            proc.kill()
            proc.wait()
        assert "went on" not in out.read_text(), f"attempt {attempt}: the thread went on past the stop"


def test_late_upload_is_damped_counted_once_and_replaced_by_a_fresh_one():
    base = {"w": np.zeros(3, np.float32)}
    current = {"w": np.ones(3, np.float32)}
    late_params = {"w": np.full(3, 4.0, np.float32)}
    window = LateWindow(1, "train", "g0", base, frozenset({"a"}))
    replies = [
        Update("b", {"w": np.full(3, 2.0, np.float32)}, 5),
        LateUpdate(Update("c", late_params, 5), 1),  # counted: 1 + 0.5·(4 − 0)
        LateUpdate(Update("b", late_params, 5), 1),  # b sent a fresh one: replaced
        LateUpdate(Update("a", late_params, 5), 1),  # a was aggregated in round 1 already
    ]
    out, late, superseded = absorb_late(replies, window, current, 0.5)
    assert (late, superseded) == (["c"], ["b"])
    counted = {u.device: u.params["w"] for u in out}
    assert sorted(counted) == ["b", "c"]
    np.testing.assert_array_equal(counted["c"], np.full(3, 3.0, np.float32))
    assert counted["c"].dtype == np.float32
    # Without a window (straggler = "drop") nothing late is counted.
    out, late, _ = absorb_late(replies, None, current, 0.5)
    assert [u.device for u in out] == ["b"] and late == []
    np.testing.assert_array_equal(damp_late(current, base, late_params, 1.0)["w"], np.full(3, 5.0))


def test_next_round_is_refused_where_a_late_upload_has_no_meaning():
    check_next_round(make_strategy(SPEC))
    feddar = TaskSpec(
        "d", "feddar", "linear_rep", model_args={"d_in": 4, "k": 2}, hparams={"n_domains": 2}, dtype="float64"
    )
    with pytest.raises(ValueError, match="straggler = 'drop'"):
        check_next_round(make_strategy(feddar))
    with pytest.raises(ValueError, match="straggler"):
        RoundEngine(SPEC, fleet=None, straggler="later")


def test_store_keeps_uploads_until_their_round_commits_and_records_extras(tmp_path):
    store = SqliteStore(tmp_path / "agg.sqlite")
    assert store.put_update("speed", 1, "train", "a", "g0", b"one")
    assert not store.put_update("speed", 1, "train", "a", "g0", b"again")  # a re-send is a duplicate
    store.put_update("speed", 2, "train", "b", "g1", b"early")
    store.close()
    store = SqliteStore(tmp_path / "agg.sqlite")  # as after a crash: still there
    assert store.stored_updates("speed", 1, "train", "g0") == [("a", b"one")]
    g = {"w": np.ones(2, np.float32)}
    rec = RoundRecord("speed", 2, "train", "completed", ["a", "c"], {}, {}, {}, "h", 0.0, 1.0)
    rec.extra = {"late": ["c"], "superseded": []}
    store.save(rec, (3, 0), g, {})
    # Round 2's commit clears its uploads and earlier rounds' leftovers (stragglers kept for it).
    assert store.stored_updates("speed", 1, "train", "g0") == []
    assert store.stored_updates("speed", 2, "train", "g1") == []
    assert store.rounds("speed")[0].extra == {"late": ["c"], "superseded": []}
    store.close()

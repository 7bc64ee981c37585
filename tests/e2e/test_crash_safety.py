"""Crash safety against real processes: the aggregator SIGKILLed at named points and at random
times resumes bit-identical; a stored upload counts though its device is gone; devices killed
mid state-write keep a verified state; stragglers, devices offline for rounds, thin rounds.

Steps are sequenced by events, never by sleeps: the aggregator freezes itself at a named
point (``IOFT_FAULT=<point>:<n>:stop``), the test acts on the fleet, then sends SIGCONT.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter

import numpy as np
import pytest

from benchmarks.reliability import CrashBench, state_trial
from checks import fault_scenarios
from checks.fault_scenarios import DEVICES, global_of, kill, wait_stopped
from cloud_aggregator import faults
from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.local.broker import start_mosquitto
from cloud_aggregator.local.fleet import aggregator_toml, pflda_task
from cloud_aggregator.rounds.stragglers import damp_late
from edge.dataset import load_dataset
from trainer_lite.algorithms import make_client
from trainer_lite.client import participate
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

P1, P2, P3 = DEVICES


# -- the aggregator killed and restarted ---------------------------------------------------------
@pytest.mark.broker
@pytest.mark.slow
def test_aggregator_killed_at_every_point_resumes_bit_identical(tmp_path):
    bench = CrashBench(tmp_path)
    try:
        plans = [
            ["after_store_update:2", "before_commit:2", "after_announce:1"],
            ["before_aggregate:2", "after_artifact:1", "after_aggregate:1", "after_save:2"],
            None,  # seeded random plan: targeted points or a kill at a random time
        ]
        trials = [bench.trial(seed, 5, plan) for seed, plan in enumerate(plans)]
    finally:
        bench.close()
    for t in trials:
        assert t.ok, t
        assert (t.completed, t.lost, t.doubled) == (5, 0, 0)
    assert [len(t.injected) for t in trials[:2]] == [3, 4]  # every targeted kill landed
    assert trials[0].restored >= 1  # uploads stored before a kill were read back, not re-sent
    assert {k.split(":")[0] for t in trials for k in t.injected} >= set(faults.POINTS)


@pytest.mark.broker
def test_stored_upload_counts_though_its_device_is_gone(fleet_procs, mosquitto, tmp_path):
    task = pflda_task("speed", 4, 3)
    for d in DEVICES:
        fleet_procs.start_device(d)
    agg = fleet_procs.start_aggregator(
        aggregator_toml(
            fleet_procs.broker_url,
            fleet_procs.work / "aggregator",
            [task],
            expected=list(DEVICES),
            deadline_s=5.0,
            min_participants=2,
            max_extensions=5,
            startup_wait_s=8,  # after the restart the dead device never comes online: don't wait long
        ),
        fault="after_store_update:1:stop",
    )
    wait_stopped(agg, 120, "after_store_update:1", fleet_procs.work / "aggregator.log")
    db = sqlite3.connect(f"file:{fleet_procs.db}?mode=ro", uri=True)
    try:
        ((gone,),) = db.execute("SELECT device FROM updates WHERE task='speed'").fetchall()
    finally:
        db.close()
    kill(fleet_procs.devices[gone])
    kill(agg)
    # The broker goes down too (no persistence): the aggregator's session, and any copy of the
    # upload the broker might have redelivered to it, are gone. Only the store has it now.
    mosquitto.kill()
    restarted = start_mosquitto(mosquitto.port, log_file=tmp_path / "mosquitto2.log")
    try:
        fleet_procs.start_aggregator((fleet_procs.work / "aggregator.toml").read_text())
        assert fleet_procs.wait_aggregator(120) == 0
    finally:
        restarted.stop()
    records = fleet_procs.rounds()
    assert [r.status for r in records] == ["completed"] * 3
    assert sorted(records[0].participants) == list(DEVICES)  # the gone device's stored upload counted
    assert all(gone not in r.participants for r in records[1:])
    assert "1 uploads restored from the store" in fleet_procs.log("aggregator")


# -- devices killed while writing state ----------------------------------------------------------
def test_device_killed_during_state_writes_keeps_a_verified_state(tmp_path):
    rng = np.random.default_rng(7)
    outcomes = Counter(state_trial(tmp_path, rng) for _ in range(16))
    assert outcomes["corrupt"] == 0, outcomes
    assert sum(outcomes.values()) == 16


# -- stragglers ------------------------------------------------------------------------------------
@pytest.mark.broker
@pytest.mark.parametrize("mode", ["drop", "next_round"])
def test_straggler_is_dropped_or_counted_in_the_next_round(fleet_procs, mode):
    run = fault_scenarios.straggler(fleet_procs, mode)
    records, sent = run.records, run.sent
    assert [r.status for r in records] == ["completed"] * 3
    assert sorted(records[0].participants) == list(DEVICES), "precondition: all answered round 1"
    assert sorted(records[1].participants) == [P1, P2]
    # Every record says how its round closed, also where no device sat it out.
    assert [r.extra["closed"] for r in records[:2]] == ["answered", "deadline"]
    assert records[1].extra["refused"] == {}
    assert run.on_wire == 8 and run.lost == 0  # round 1 x3, rounds 2-3 x2, printer3's late round 2
    if mode == "drop":
        assert sorted(records[2].participants) == [P1, P2]
        assert "late" not in records[2].extra
        assert run.refused_late == 1  # dropped as configured, and counted as a refusal
        return
    assert sorted(records[2].participants) == list(DEVICES)
    assert (records[2].extra["late"], records[2].extra["superseded"]) == ([P3], [])
    assert (run.late_counted, run.refused_late) == (1, 0)
    # Round 3's global, recomputed from what was on the wire: printer3's round-2 change, halved
    # and applied to round 3's starting global, averaged with the two fresh uploads.
    g1, g2 = (global_of(fleet_procs, r.global_hash) for r in records[:2])
    late = sent[P3][2]
    assert late.global_hash == param_hash(g1)
    updates = [
        Update(P1, sent[P1][3].params, sent[P1][3].n_samples),
        Update(P2, sent[P2][3].params, sent[P2][3].n_samples),
        Update(P3, damp_late(g2, g1, late.params, 0.5), late.n_samples),
    ]
    spec = TaskSpec.from_json(json.dumps(run.extras["task"]))
    expected = make_strategy(spec).aggregate(g2, updates, round_=3, phase=records[2].phase)
    assert param_hash(expected) == records[2].global_hash


# -- a device offline for several rounds ---------------------------------------------------------------
@pytest.mark.broker  # mosquitto only: it checks the retained (closed) round is answered first
def test_device_offline_for_rounds_rejoins_with_its_personal_state(fleet_procs):
    run = fault_scenarios.offline_rejoin(fleet_procs)
    records, saved = run.records, run.extras["saved"]
    sent = run.sent[P3]
    assert [r.status for r in records] == ["completed"] * 7
    assert saved is not None and saved.answered[0] == 2, "precondition: printer3 answered round 2"
    assert [sorted(r.participants) for r in records[2:5]] == [[P1, P2]] * 3
    assert [sorted(r.participants) for r in records[5:]] == [list(DEVICES)] * 2
    # Back online between rounds 5 and 6, it first answered the retained (closed) round 5 —
    # refused as stale and counted — then round 6.  Both uploads follow from the personal state
    # saved before the kill: it survived the kill and the restart, and each time the device
    # took the global on the wire.
    assert sorted(sent) == [1, 2, 5, 6, 7]
    assert (run.refused_late, run.lost) == (1, 0)
    spec = TaskSpec.from_json(json.dumps(run.extras["task"]))
    algo = make_client(spec)
    train, test, _ = load_dataset(fleet_procs.work / P3)
    g4, g5 = (global_of(fleet_procs, r.global_hash) for r in records[3:5])
    assert (sent[5].global_hash, sent[6].global_hash) == (param_hash(g4), param_hash(g5))
    phase = records[5].phase
    r5, local5 = participate(algo, P3, g4, saved.local, train, test, round_=5, phase=phase)
    r6, _ = participate(algo, P3, g5, local5, train, test, round_=6, phase=phase)
    assert param_hash(r5.shared) == param_hash(sent[5].params)
    assert param_hash(r6.shared) == param_hash(sent[6].params)
    assert "afresh" not in fleet_procs.log(P3) and "resetting" not in fleet_procs.log(P3)


# -- rounds without enough participants -------------------------------------------------------------
@pytest.mark.broker
@pytest.mark.slow
def test_thin_round_is_extended_then_completed_or_abandoned_cleanly(fleet_procs):
    run = fault_scenarios.thin_round(fleet_procs)
    records = run.records
    assert [r.status for r in records] == ["completed", "completed", "abandoned", "abandoned"]
    assert sorted(records[1].participants) == list(DEVICES)
    # The global stays through abandoned rounds; each is recorded and the next one starts.
    assert records[3].global_hash == records[2].global_hash == records[1].global_hash
    assert records[3].started >= records[2].finished
    text = fleet_procs.log("aggregator")
    assert text.count("extending the deadline (3/3)") == 2  # rounds 3 and 4 waited it out
    assert "task speed round 4 phase train abandoned: 2 valid uploads < min_participants 3" in text
    assert (run.on_wire, run.lost) == (10, 0)  # the abandoned rounds' uploads are on record

"""Buffered asynchronous rounds (FedBuff) over a real mosquitto: ``serve`` with ``mode = "buffered"``
and ``edge-trainer`` processes that train continuously at simulated speeds (``[simulate]``).

Nothing here asserts on wall-clock time: the slow device is 15× slower than the fast ones, so
its uploads land many versions late whatever the machine's load, and every wait is a poll with
a generous bound.
"""

from __future__ import annotations

import math
import signal
from collections import Counter

import pytest

from cloud_aggregator.local.fleet import aggregator_toml, pflda_task
from cloud_aggregator.store.sqlite import SqliteStore

FAST = ["printer1", "printer2"]
SLOW = "printer3"
LATE = "printer4"  # joins mid-run
MAX_STALENESS = 4


def device_toml(fleet_procs, name: str, update_s: float) -> str:
    path = fleet_procs.work / f"{name}.toml"
    path.write_text(f"[simulate]\nupdate_s = {update_s}\njitter = 0.2\nseed = 3\n")
    return str(path)


def buffered_task(rounds: int) -> dict[str, object]:
    return {
        **pflda_task(rounds=rounds),
        "mode": "buffered",
        "buffered": {"k": 1, "server_lr": 1.0, "max_staleness": MAX_STALENESS},
    }


@pytest.mark.broker
@pytest.mark.slow
def test_buffered_task_over_mqtt_with_a_slow_device_a_newcomer_and_a_restart(fleet_procs):
    for d in FAST:
        fleet_procs.start_device(d, "--config", device_toml(fleet_procs, d, 0.3))
    fleet_procs.start_device(SLOW, "--config", device_toml(fleet_procs, SLOW, 4.5))
    toml = aggregator_toml(
        fleet_procs.broker_url, fleet_procs.work / "aggregator", [buffered_task(60)], expected=[*FAST, SLOW]
    )
    fleet_procs.start_aggregator(toml)
    fleet_procs.wait_for(lambda: len(fleet_procs.rounds()) >= 15, 120, "15 buffer applications")

    # A device that joins mid-run pulls the retained newest global and its uploads count.
    fleet_procs.start_device(LATE, "--config", device_toml(fleet_procs, LATE, 0.3))
    fleet_procs.wait_for(
        lambda: any(LATE in r.participants for r in fleet_procs.rounds()), 120, "the newcomer's upload"
    )

    # SIGKILL the aggregator; the restarted one goes on from the stored version.
    before = len(fleet_procs.rounds())
    fleet_procs.aggregator.send_signal(signal.SIGKILL)
    fleet_procs.aggregator.wait(10)
    stored = fleet_procs.rounds()
    fleet_procs.start_aggregator(toml)
    assert fleet_procs.wait_aggregator(240) == 0, fleet_procs.log("aggregator")[-4000:]

    records = fleet_procs.rounds()
    assert len(stored) >= before
    # Every version from 1 to 60 was recorded once, in order; the restart lost none and repeated none.
    assert [r.round for r in records] == list(range(1, 61))
    assert all(r.status == "completed" and r.extra["mode"] == "buffered" for r in records)
    assert records[: len(stored)] == stored  # the restart rewrote nothing it had stored
    log = fleet_procs.log("aggregator")
    assert f"resumes buffered at version {len(stored)}" in log

    # Every application is K = 1 staleness-weighted arrival: 1/sqrt(1 + tau); some arrived late.
    arrivals = [a for r in records for a in r.extra["arrivals"]]
    assert all(len(r.extra["arrivals"]) == 1 for r in records)
    assert all(w == pytest.approx(1 / math.sqrt(1 + tau), abs=1e-6) for _, tau, w in arrivals)
    assert any(tau >= 1 and w < 1 for _, tau, w in arrivals), arrivals
    assert all(tau <= MAX_STALENESS for _, tau, _ in arrivals)

    # The slow device's uploads are many versions old: refused with a reason, never buffered.
    store = SqliteStore(fleet_procs.db)
    try:
        refused = store.rejection_counts_by_reason("speed")
    finally:
        store.close()
    assert refused.get(SLOW, {}).get("stale_round", 0) >= 1, refused
    assert "max_staleness 4" in log
    assert {d for r in records for d in r.participants} >= {*FAST, LATE}
    ledger = records[-1].extra["ledger"]  # since the restart: it adds up
    assert ledger["arrived"] == ledger["buffered"] + ledger["too_stale"] + ledger["refused"]


@pytest.mark.broker
def test_a_swarm_trains_a_buffered_task_continuously(fleet_procs):
    # The swarm's devices run the daemon's own round code: one network loop paces them all.
    n = 12
    names = [f"dev{i:05d}" for i in range(n)]
    fleet_procs.start_device(
        "dev", "--swarm", str(n), "--config", device_toml(fleet_procs, "dev", 0.2), "--log-level", "WARNING"
    )
    task = {**buffered_task(15), "buffered": {"k": 4, "server_lr": 1.0, "max_staleness": 50}}
    toml = aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=names)
    fleet_procs.start_aggregator(toml, log_level="WARNING")
    assert fleet_procs.wait_aggregator(180) == 0, fleet_procs.log("aggregator")[-3000:]
    records = fleet_procs.rounds()
    assert [r.round for r in records] == list(range(1, 16))
    assert all(len(r.extra["arrivals"]) == 4 for r in records)
    assert len({d for r in records for d in r.participants}) >= n // 2  # many devices, not one
    # Devices kept training: 60 admitted uploads from 12 devices, most of them more than once each.
    per_device = Counter(d for r in records for d, _, _ in r.extra["arrivals"])
    assert sum(per_device.values()) == 60 and sum(v >= 2 for v in per_device.values()) >= n // 2

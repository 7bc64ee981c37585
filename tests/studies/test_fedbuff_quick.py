"""Quick mode of ``benchmarks.fedbuff_vs_sync``: with 10% of the printers 10× slower and 5% churn,
FedBuff reaches the synchronous run's fleet loss in less simulated time."""

from __future__ import annotations

import math

from benchmarks.fedbuff_sim import Conditions, FleetClock
from benchmarks.fedbuff_vs_sync import QUICK, Method, run_seed


def test_fedbuff_reaches_syncs_loss_sooner_in_simulated_time() -> None:
    methods = [Method(3, 0.5), Method(10, 1.0)]
    result = run_seed(
        0, methods, devices=QUICK["devices"], rounds=QUICK["rounds"], algorithm="pflda", cap=2.0
    )
    sync = result.curves["sync"].time_to(result.target)
    assert math.isfinite(sync)
    for m in methods:
        fedbuff = result.curves[m.label].time_to(result.target)
        assert fedbuff < sync, (m.label, fedbuff, sync)
        ledger = result.ledgers[m.label]
        assert ledger["arrived"] == ledger["buffered"] + ledger["too_stale"] + ledger["refused"]
        assert ledger["dispatched"] == (
            ledger["buffered"] + ledger["too_stale"] + ledger["abandoned"] + ledger["outstanding"]
        )


def test_the_fleet_clock_is_the_conditions() -> None:
    names = [f"printer{i}" for i in range(1, 21)]
    clock = FleetClock(names, Conditions(devices=20), seed=0)
    assert sorted(clock.speed.values()).count(10.0) == 2  # 10% of the fleet, 10× slower
    # 5% churn: about 5% of device-time away (mean away 10·T0, P(leave within 10·T0) = 5%).
    away = sum(not clock.online(d, t) for d in names for t in range(0, 20_000, 10)) / (len(names) * 2000)
    assert 0.03 < away < 0.07, away

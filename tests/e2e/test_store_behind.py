"""A store behind its devices says so, and ``serve --resume-from-devices`` goes on.

Before: with a fresh (or an older) ``aggregator.sqlite`` for a task its devices had trained,
the devices ignored every announcement below their round, ``serve`` logged "0 valid
uploads" round after round and nothing said why.  Real ``serve`` and ``edge-trainer``
processes on a real mosquitto.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

from cloud_aggregator import faults
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml, pflda_task
from tests.e2e.retained import retained_status

pytestmark = pytest.mark.broker
DEVICES = ["printer1", "printer2"]


def _toml(fleet: LocalFleet, rounds: int) -> str:
    return aggregator_toml(
        fleet.broker_url,
        fleet.work / "aggregator",
        [pflda_task(rounds=rounds)],
        expected=DEVICES,
        deadline_s=2,
    )


def _serve(fleet: LocalFleet, toml: str, *args: str) -> None:
    """``serve --config`` with ``args``, as :attr:`LocalFleet.aggregator` (log: aggregator.log)."""
    cfg = fleet.work / "aggregator.toml"
    cfg.write_text(toml)
    with (fleet.work / "aggregator.log").open("ab") as log:
        fleet.aggregator = subprocess.Popen(
            [sys.executable, "-m", "cloud_aggregator.cli", "serve", "--config", str(cfg), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**faults.child_env(None), "PYTHONUNBUFFERED": "1"},
        )


def test_devices_ahead_of_a_fresh_store_are_named_and_serve_resumes_past_them(fleet_procs: LocalFleet):
    fleet_procs.start_devices(DEVICES)
    fleet_procs.start_aggregator(_toml(fleet_procs, 3))
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    assert [r.round for r in fleet_procs.rounds()] == [1, 2, 3]

    # The store is lost (a fresh one for the same task): the devices trained round 3 already.
    shutil.rmtree(fleet_procs.work / "aggregator")
    before = fleet_procs.log("aggregator")
    fleet_procs.start_aggregator(_toml(fleet_procs, 6))
    fleet_procs.wait_for(
        lambda: "trained past it already" in fleet_procs.log("aggregator")[len(before) :],
        90,
        "serve to name the devices ahead of its store",
    )
    said = fleet_procs.log("aggregator")[len(before) :]
    assert "printer1 (round 3," in said and "printer2 (round 3," in said, said
    assert "--resume-from-devices" in said
    status = retained_status(fleet_procs.broker_url, "printer1")
    ahead = status.get("ahead_of_aggregator", {}).get("speed", {})
    assert ahead.get("device_round") == 3 and ahead.get("announced_round", 99) <= 3, status
    fleet_procs.aggregator.send_signal(signal.SIGTERM)
    assert fleet_procs.wait_aggregator(30) == 0

    # Told to, serve goes on past the devices' round, and they answer again.
    before = fleet_procs.log("aggregator")
    _serve(fleet_procs, _toml(fleet_procs, 6), "--resume-from-devices")
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    said = fleet_procs.log("aggregator")[len(before) :]
    assert "to round 4, past its devices'" in said, said
    completed = [r for r in fleet_procs.rounds() if r.status == "completed"]
    assert [r.round for r in completed] == [4, 5, 6], [(r.round, r.status) for r in fleet_procs.rounds()]
    assert all(sorted(r.participants) == DEVICES for r in completed)
    assert "ahead_of_aggregator" not in retained_status(fleet_procs.broker_url, "printer1")

"""A device with a wrong ``fleet =``, on a real mosquitto: within seconds it
says that no aggregator of its fleet answers (log and retained status), and ``fleet status``
names it as a device speaking for another fleet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml, pflda_task

UNHEARD = "no aggregator of fleet 'tset' has answered"


def _status(url: str, fleet: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cloud_aggregator.cli", "fleet", "status", "--broker", url, "--fleet", fleet]
    return subprocess.run([*cmd, "--allow-plaintext", *extra], capture_output=True, text=True, timeout=60)


@pytest.mark.broker
def test_a_device_of_a_mistyped_fleet_says_so_and_fleet_status_shows_it(fleet_procs):
    # Prepare: printer1 in the aggregator's fleet, printer9 with a typo in its fleet id.
    typo = LocalFleet(fleet_procs.work, fleet_procs.broker_url, fleet="tset")
    try:
        fleet_procs.start_device("printer1")
        typo.start_device("printer9")
        fleet_procs.start_aggregator(
            aggregator_toml(
                fleet_procs.broker_url,
                fleet_procs.work / "aggregator",
                [pflda_task(rounds=2)],
                expected=["printer1"],
            )
        )
        # Execute + assert: the mistyped device says it, once, while the fleet trains without it.
        fleet_procs.wait_for(lambda: UNHEARD in fleet_procs.log("printer9"), 90, "printer9's warning")
        assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
        assert [sorted(r.participants) for r in fleet_procs.rounds()] == [["printer1"], ["printer1"]]
        typo_log = fleet_procs.log("printer9")
        assert typo_log.count(UNHEARD) == 1 and "check that `fleet =` in device.toml" in typo_log
        assert "answered" not in typo_log.split(UNHEARD)[1].replace("has answered", "")
        own = json.loads(_status(fleet_procs.broker_url, "tset", "--json").stdout)
        assert UNHEARD in own["printer9"]["aggregator"]  # in its retained status too
        out = _status(fleet_procs.broker_url, "test")
    finally:
        typo.stop_all()
    assert out.returncode == 0, out.stderr
    assert "printer1" in out.stdout
    assert "devices speaking for another fleet than 'test': printer9 (fleet 'tset')" in out.stdout, out.stdout

"""A device owner pauses and resumes taking part, the daemon running throughout.

Three real ``edge-trainer`` processes and ``cloud-aggregator serve`` over mosquitto.
``edge-trainer pause`` on printer3: its retained status refuses the task ("paused by its
owner"), so no round waits for it: every round closes on the other two's answers, never
by its (long) deadline, and the record says who sat out and why.  ``edge-trainer
resume``: the refusal goes, and the task's next rounds (the task extended, ``serve
--service`` re-reading its config on SIGHUP) wait for printer3 and include it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from cloud_aggregator.local.fleet import aggregator_toml, pflda_task
from edge import optout
from tests.e2e.retained import retained_status

DEVICES = ["printer1", "printer2", "printer3"]
SERVE = (sys.executable, "-m", "cloud_aggregator.cli", "serve", "--service")


def wait_status(url: str, device: str, cond, what: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = retained_status(url, device, timeout=1.0)
        if cond(status):
            return status
        assert time.monotonic() < deadline, f"{device} never {what}: {status}"
        time.sleep(0.2)


@pytest.mark.broker
@pytest.mark.any_broker
@pytest.mark.slow
def test_a_paused_device_is_not_waited_for_and_resume_brings_it_back(fleet_procs):
    # Prepare: three printers online; printer3's owner pauses it (the daemon keeps running)
    url, work = fleet_procs.broker_url, fleet_procs.work
    fleet_procs.start_devices(DEVICES, "--log-level", "WARNING")
    for d in DEVICES:
        wait_status(url, d, lambda s: s.get("state") == "online", "came online", timeout=60)
    optout.pause(work / "printer3", "printer rebuild")  # `edge-trainer pause` (tests/edge/test_optout.py)
    wait_status(url, "printer3", lambda s: "paused" in s, "said it is paused")

    def toml(rounds: int) -> str:
        task = pflda_task(rounds=rounds)
        return aggregator_toml(url, work / "aggregator", [task], expected=DEVICES, deadline_s=60.0)

    # Execute / Assert: paused, printer3 is not waited for (a 60 s deadline no round reaches)
    config = work / "aggregator.toml"
    config.write_text(toml(rounds=2))
    with (work / "aggregator.log").open("ab") as log:
        agg = fleet_procs.aggregator = subprocess.Popen(  # stopped by the fixture
            [*SERVE, "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
    fleet_procs.wait_for(lambda: len(fleet_procs.rounds()) == 2, 60, "rounds 1-2")
    records = fleet_procs.rounds()
    assert [r.status for r in records] == ["completed"] * 2
    for r in records:
        assert sorted(r.participants) == ["printer1", "printer2"], r.round
        assert r.extra["closed"] == "answered", (r.round, r.extra)
        assert r.extra["refused"]["printer3"] == "paused by its owner: printer rebuild"
    status = retained_status(url, "printer3")
    assert status["state"] == "online" and status["refused"] == {
        "speed": "paused by its owner: printer rebuild"
    }

    # Resumed: the refusal goes, and the extended task's rounds wait for printer3 again
    assert optout.resume(work / "printer3")
    wait_status(url, "printer3", lambda s: "paused" not in s and not s.get("refused"), "resumed")
    config.write_text(toml(rounds=4))
    agg.send_signal(signal.SIGHUP)  # serve --service takes the extended task
    fleet_procs.wait_for(lambda: len(fleet_procs.rounds()) == 4, 60, "rounds 3-4")
    # An idle `serve --service` reads the statuses that came meanwhile once round 3 is open: a
    # round awaits again a device that refused when it began and takes the task once more.
    for r in fleet_procs.rounds()[2:]:
        assert r.status == "completed" and sorted(r.participants) == DEVICES, r.round
        assert r.extra["closed"] == "answered" and not r.extra.get("refused"), r.extra  # nobody sat out
    assert all(fleet_procs.devices[d].poll() is None for d in DEVICES)  # never stopped
    assert "Traceback" not in fleet_procs.log("printer3")

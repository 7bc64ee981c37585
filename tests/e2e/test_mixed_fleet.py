"""A mixed fleet over mosquitto: printers and welders online, a printer task and a weld task.

No round waits for a device that cannot run it: a welder refuses the printer task (its
624 features are not the model's 1 input), a printer refuses the weld task (the task
selects ``kind = "welder"``), each at once, in its retained status; the rounds close
because every awaited device answered, never by their deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cloud_aggregator.local_fleet import FLEET, aggregator_toml, pflda_task

PRINTERS = ["printer1", "printer2"]
WELDERS = ["welder1", "welder2"]
ROUNDS = 3
STATUS = (sys.executable, "-m", "cloud_aggregator.cli", "fleet", "status")
WELD_TASK = {
    "name": "tool",
    "algorithm": "fedavg",
    "model": "mlp",
    "rounds": ROUNDS,
    "model_args": {"sizes": [624, 16, 4], "init": "kaiming"},
    "hparams": {"lr": 0.001, "loss": "cross_entropy", "local_steps": 2, "batch_size": 8},
    "devices": {"kind": "welder"},
}


@pytest.mark.broker
def test_mixed_fleet_rounds_never_wait_for_devices_that_cannot_run_them(fleet_procs):
    # Prepare: two simulated printers, two simulated welders; a deadline no round should reach.
    fleet_procs.start_devices(PRINTERS, "--log-level", "WARNING")
    fleet_procs.start_devices(WELDERS, "--log-level", "WARNING", simulate="welder")
    toml = aggregator_toml(
        fleet_procs.broker_url,
        fleet_procs.work / "aggregator",
        [pflda_task(rounds=ROUNDS), WELD_TASK],
        expected=PRINTERS + WELDERS,
        deadline_s=60.0,
        startup_wait_s=120.0,
    )

    # Execute
    fleet_procs.start_aggregator(toml)
    assert fleet_procs.wait_aggregator(240) == 0, fleet_procs.log("aggregator")[-3000:]

    # Assert: each task ran on its own machines, every round closed on its answers.
    for task, ran, sat_out in (("speed", PRINTERS, WELDERS), ("tool", WELDERS, PRINTERS)):
        records = fleet_procs.rounds(task)
        assert [r.status for r in records] == ["completed"] * ROUNDS, task
        for r in records:
            assert sorted(r.participants) == ran, (task, r.round)
            assert r.extra["closed"] == "answered", (task, r.round, r.extra)
            assert sorted(r.extra["refused"]) == sat_out, (task, r.round, r.extra)
    welder_why = fleet_procs.rounds("speed")[0].extra["refused"]["welder1"]
    assert "1 input features" in welder_why and "624" in welder_why
    assert "welder" in fleet_procs.rounds("tool")[0].extra["refused"]["printer1"]

    # Each device's refusal shows in `fleet status --json`, with its reason and its kind.
    out = subprocess.run(
        [*STATUS, "--fleet", FLEET, "--broker", fleet_procs.broker_url, "--allow-plaintext", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    statuses = json.loads(out.stdout)
    for d in PRINTERS:
        assert statuses[d]["kind"] == "printer" and set(statuses[d]["refused"]) == {"tool"}
    for d in WELDERS:
        assert statuses[d]["kind"] == "welder" and set(statuses[d]["refused"]) == {"speed"}
        assert "624" in statuses[d]["refused"]["speed"]

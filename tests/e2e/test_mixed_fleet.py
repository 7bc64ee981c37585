"""A mixed fleet over mosquitto: printers and welders online, a printer task and a weld task.

No round waits for a device that cannot run it: a printer refuses the weld task (the task
selects ``kind = "welder"``) and a welder the printer task, each at once, in its retained
status; the rounds close because every awaited device answered, never by their deadline.
The two tasks select different kinds, so they run side by side; a third task that selects
no kind (a welder refuses it: its 624 features are not the model's 1 input) waits for both.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cloud_aggregator.local.fleet import FLEET, aggregator_toml, pflda_task

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
@pytest.mark.any_broker
def test_mixed_fleet_rounds_never_wait_for_devices_that_cannot_run_them(fleet_procs):
    # Prepare: two simulated printers, two simulated welders; a deadline no round should reach.
    fleet_procs.start_devices(PRINTERS, "--log-level", "WARNING")
    fleet_procs.start_devices(WELDERS, "--log-level", "WARNING", simulate="welder")
    speed = {**pflda_task(rounds=ROUNDS), "devices": {"kind": "printer"}}
    toml = aggregator_toml(
        fleet_procs.broker_url,
        fleet_procs.work / "aggregator",
        [speed, WELD_TASK, pflda_task("probe", rounds=1)],
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
    assert "printer" in fleet_procs.rounds("speed")[0].extra["refused"]["welder1"]
    assert "welder" in fleet_procs.rounds("tool")[0].extra["refused"]["printer1"]
    (probe,) = fleet_procs.rounds("probe")
    assert sorted(probe.participants) == PRINTERS and probe.extra["closed"] == "answered"
    welder_why = probe.extra["refused"]["welder1"]
    assert "1 input features" in welder_why and "624" in welder_why

    # Side by side: each of the two tasks began its first round before the other ended its last;
    # the probe, which may share devices with both, began after both had ended.
    speed_rounds, tool_rounds = fleet_procs.rounds("speed"), fleet_procs.rounds("tool")
    assert tool_rounds[0].started < speed_rounds[-1].finished
    assert speed_rounds[0].started < tool_rounds[-1].finished
    assert probe.started >= max(speed_rounds[-1].finished, tool_rounds[-1].finished)

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
        assert statuses[d]["kind"] == "welder" and set(statuses[d]["refused"]) == {"speed", "probe"}
        assert "624" in statuses[d]["refused"]["probe"]

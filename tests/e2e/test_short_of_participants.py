"""A task whose rounds cannot reach ``min_participants`` says so at once.

The README's old sample: printer1, printer2 and welder1 with ``[collect] min_participants = 3``
and a printer task that selects no kind.  The welder refuses it (its 624 features are not the
model's 1 input), so every round waited its deadline, was extended twice and was abandoned,
and nothing in ``serve``'s log said why.  Now ``serve`` says it in one line as soon as the
welder's refusal is in (naming the task, the minimum, who takes it and who refuses it and
why), and the extension line names the task.  Real mosquitto, real ``edge-trainer`` processes.
"""

from __future__ import annotations

import re

import pytest

from cloud_aggregator.local.fleet import aggregator_toml, pflda_task

PRINTERS = ["printer1", "printer2"]


def short_line(log: str) -> str | None:
    found = [ln for ln in log.splitlines() if "cannot reach [collect] min_participants" in ln]
    return found[0] if found else None


@pytest.mark.broker
def test_serve_names_the_devices_that_keep_a_task_below_min_participants(fleet_procs):
    # Prepare: the sample fleet; the task as the old sample had it (no device selection).
    fleet_procs.start_devices(PRINTERS, "--log-level", "WARNING")
    fleet_procs.start_device("welder1", "--log-level", "WARNING", simulate="welder")
    toml = aggregator_toml(
        fleet_procs.broker_url,
        fleet_procs.work / "aggregator",
        [pflda_task(rounds=2)],
        min_participants=3,
        deadline_s=2.0,
        max_extensions=1,
        expected=[*PRINTERS, "welder1"],
        startup_wait_s=120.0,
    )

    # Execute: wait for round 2's extension (the line names the task); round 1 was abandoned.
    fleet_procs.start_aggregator(toml)
    fleet_procs.wait_for(
        lambda: "task speed round 2: 2 valid uploads < min_participants 3" in fleet_procs.log("aggregator"),
        180,
        "round 2's deadline extension",
    )

    # Assert: the cause was said in one line, once (not again for round 2, nothing changed).
    log = fleet_procs.log("aggregator")
    line = short_line(log)
    assert line is not None, log[-3000:]
    assert re.search(r"task speed: .*min_participants = 3 .*2 take it \(printer1, printer2\)", line), line
    assert "welder1 refuses it:" in line and "624" in line, line
    assert "printer1 refuses" not in line, line
    assert log.count("cannot reach [collect] min_participants") == 1, log[-3000:]

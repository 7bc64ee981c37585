"""The README's DP task over a real fleet: mosquitto, ``cloud-aggregator serve`` and two
``edge-trainer`` processes; ε is in each round's record in the store and in ``fleet privacy``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cloud_aggregator.aggregation.accountant import epsilon
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.local.fleet import aggregator_toml
from ioft_protocol.config import build

README = Path(__file__).resolve().parents[2] / "docs" / "formats.md"  # moved from README.md
DEVICES = ["printer1", "printer2"]


def readme_dp_task() -> dict:
    blocks = dict(re.findall(r"```[a-z]*\n# README example: (\S+)\n(.*?)```", README.read_text(), re.S))
    (task,) = tomllib.loads(blocks["dp-task.toml"])["task"]
    return task


def test_the_readmes_dp_example_validates_on_the_aggregator():
    cfg = build(AggregatorConfig, {"task": [readme_dp_task()]}, "README dp-task.toml")
    (task,) = cfg.task
    assert task.dp is not None and task.dp.mode == "distributed" and task.dp.epsilon_budget == 8.0


@pytest.mark.broker
def test_a_dp_task_trains_over_mqtt_and_its_epsilon_is_recorded_and_shown(fleet_procs):
    task = readme_dp_task()
    task["rounds"] = 2
    task["dp"] = {**task["dp"], "devices_per_round": len(DEVICES)}
    for d in DEVICES:
        fleet_procs.start_device(d)
    state = fleet_procs.work / "aggregator"
    fleet_procs.start_aggregator(aggregator_toml(fleet_procs.broker_url, state, [task], expected=DEVICES))
    assert fleet_procs.wait_aggregator(90) == 0, fleet_procs.log("aggregator")[-3000:]

    records = fleet_procs.rounds("speed-dp")
    assert [(r.round, r.status, sorted(r.participants)) for r in records] == [
        (1, "completed", DEVICES),
        (2, "completed", DEVICES),
    ]
    z, delta = task["dp"]["noise_multiplier"], task["dp"]["delta"]
    spent = [r.extra["dp"]["epsilon"] for r in records]
    assert spent == pytest.approx([epsilon([z] * k, 1.0, delta) for k in (1, 2)], rel=1e-5)
    assert all(r.extra["dp"]["delta"] == delta and r.extra["dp"]["mode"] == "distributed" for r in records)
    assert "speed-dp round 2: ε = " in fleet_procs.log("aggregator")  # the serve log line

    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "cloud_aggregator.cli",
            "fleet",
            "privacy",
            "--state-dir",
            str(state),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    (row,) = json.loads(shown.stdout)
    assert row["task"] == "speed-dp" and row["round"] == 2 and row["epsilon"] == pytest.approx(spent[-1])

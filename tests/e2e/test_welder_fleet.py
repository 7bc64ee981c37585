"""Welders over MQTT: simulated welds enter through the watched-folder source, become
624 DWT features labelled from the maintenance log, and train a shared classifier."""

from __future__ import annotations

import pytest

from cloud_aggregator.local.fleet import aggregator_toml
from edge.dataset import load_dataset

WELDERS = ["welder1", "welder2", "welder3"]
TASK = {
    "name": "tool",
    "algorithm": "fedavg",
    "model": "mlp",
    "rounds": 4,
    "seed": 0,
    "model_args": {"sizes": [624, 32, 4], "init": "kaiming"},
    "hparams": {"lr": 0.001, "loss": "cross_entropy", "local_steps": 5, "batch_size": 8},
}


@pytest.mark.broker
def test_welders_train_a_tool_condition_classifier(fleet_procs):
    for d in WELDERS:
        fleet_procs.start_device(d, "--simulate", "welder")
    fleet_procs.start_aggregator(
        aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", [TASK], expected=WELDERS)
    )
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")[-3000:]
    records = fleet_procs.rounds("tool")
    assert [r.status for r in records] == ["completed"] * 4
    assert all(sorted(r.participants) == WELDERS for r in records)
    assert all("test_accuracy" in m for m in records[-1].metrics.values())
    for d in WELDERS:
        train, test, meta = load_dataset(fleet_procs.work / d)
        assert train.x.shape[1] == 624 and meta["schema_hash"]
        # Every simulated weld went through the folder source exactly once.
        assert len(train) + len(test) == 48

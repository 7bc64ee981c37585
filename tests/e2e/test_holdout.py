"""Held-out devices over mosquitto (the IoFT talk's held-out-device testing): a task's
``holdout`` devices never train or upload; each round they score the global model on
their own rows and report it in their retained status, and the round's record keeps it.
"""

from __future__ import annotations

import pytest

from cloud_aggregator.local.fleet import aggregator_toml, pflda_task

TRAINING = ["printer1", "printer2"]
HELD_OUT = "printer3"
ROUNDS = 2


@pytest.mark.broker
@pytest.mark.any_broker
def test_a_held_out_device_scores_every_global_and_never_trains(fleet_procs):
    fleet_procs.start_devices([*TRAINING, HELD_OUT], "--log-level", "INFO")
    task = {**pflda_task(rounds=ROUNDS), "algorithm": "fedavg", "holdout": [HELD_OUT]}
    toml = aggregator_toml(
        fleet_procs.broker_url,
        fleet_procs.work / "aggregator",
        [task],
        expected=[*TRAINING, HELD_OUT],
        deadline_s=60.0,
    )

    fleet_procs.start_aggregator(toml)
    assert fleet_procs.wait_aggregator(180) == 0, fleet_procs.log("aggregator")[-3000:]

    records = fleet_procs.rounds("speed")
    assert [r.status for r in records] == ["completed"] * ROUNDS
    for r in records:
        assert sorted(r.participants) == TRAINING, r.round  # it uploaded nothing
        assert r.extra["closed"] == "answered", r.extra  # the round waited for its score, not a deadline
        (score,) = r.extra["holdout"].values()
        assert set(r.extra["holdout"]) == {HELD_OUT} and score["loss"] >= 0.0, r.extra
    # Each round's score is of that round's own global: they differ as the model trains.
    assert records[0].extra["holdout"] != records[1].extra["holdout"]
    assert "held out, the global scores" in fleet_procs.log(HELD_OUT)
    assert "held out" not in fleet_procs.log("printer1")

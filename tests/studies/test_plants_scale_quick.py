"""benchmarks.plants_scale --quick: 2 plants × 20 swarm devices, each plant with its own bridged
mosquitto and partial aggregator, against the same 40 devices straight to the cloud broker.
Properties only, never times: the top aggregator receives one batch per plant per round and no
device upload (the flat one receives every upload), and every round's global is the flat fleet's,
bit for bit (FedAvg folds exactly)."""

from __future__ import annotations

import pytest

from benchmarks import plants_scale


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("poll_s", [plants_scale.POLL_S, 120.0], ids=["polled", "finished-between-polls"])
def test_the_top_aggregator_folds_one_batch_per_plant_and_reaches_the_flat_global(monkeypatch, poll_s):
    # At 120 s a poll the monitor sees round 0, then ``serve`` finishing its whole task: the rounds it
    # missed between polls still count (a CI run once failed on "exit 0 after 2 rounds" of 3).
    monkeypatch.setattr(plants_scale, "POLL_S", poll_s)
    out = plants_scale.main(["--quick", "--no-write"])
    by_layout = {r["plants"]: r for r in out["results"]}
    plants, flat = by_layout[2], by_layout[0]
    rounds = len(plants["all_globals"])
    assert rounds == len(flat["all_globals"]) >= 3, out["table"]
    assert plants["all_participants"] == flat["all_participants"] == [40] * rounds
    # The top aggregator's inbound work: P partial sums per round, not N uploads ...
    assert plants["total"].get("batch") == 2 * rounds, plants["total"]
    assert plants["total"].get("upload", 0) == 0, plants["total"]
    # ... where the flat one reads every device's upload (a re-sent one may count twice).
    assert flat["total"].get("upload", 0) >= 40 * rounds and flat["total"].get("batch", 0) == 0, flat["total"]
    # The same model: each round's global through the plants is the flat fleet's, bit for bit.
    assert plants["all_globals"] == flat["all_globals"]

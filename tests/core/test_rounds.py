"""The round engine: validation, abandoned rounds, and resuming to the same result."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_aggregator.rounds import MemoryStore, Rejection, RoundEngine
from cloud_aggregator.simulation import ClientData, SimulatedFleet, simulate
from cloud_aggregator.store import SqliteStore
from cloud_aggregator.strategies import Update
from edge.config import DataConfig
from edge.dataset import simulated_printer_dataset
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

SPEC = TaskSpec(
    "speed",
    "pflda",
    "sigmoid_glm",
    hparams={"lr": 0.1, "local_steps": 5},
    server={"weighting": "uniform"},
    rounds=6,
)


def printers(n: int = 4) -> dict[str, ClientData]:
    out = {}
    for i in range(1, n + 1):
        train, test, _ = simulated_printer_dataset(f"printer{i}", DataConfig(source="simulate-printer"))
        out[f"printer{i}"] = ClientData(train, test)
    return out


def test_simulation_is_deterministic_and_learns():
    g1, _, rec1 = simulate(SPEC, printers())
    g2, _, rec2 = simulate(SPEC, printers())
    assert param_hash(g1) == param_hash(g2)
    assert rec1[-1].mean_metric("test_loss") < rec1[0].mean_metric("test_loss")
    assert [r.global_hash for r in rec1] == [r.global_hash for r in rec2]


class FlakyFleet:
    """Wraps a simulated fleet and crashes the 'aggregator' after a given number of phases."""

    def __init__(self, inner, crash_after):
        self.inner, self.crash_after, self.calls = inner, crash_after, 0

    def collect(self, request):
        self.calls += 1
        if self.calls > self.crash_after:
            raise KeyboardInterrupt("simulated crash")
        return self.inner.collect(request)


def test_resume_from_sqlite_gives_identical_final_parameters(tmp_path):
    clean, _, _ = simulate(SPEC, printers())
    fleet = SimulatedFleet(SPEC, printers())  # device state survives the aggregator crash
    store = SqliteStore(tmp_path / "agg.sqlite")
    with pytest.raises(KeyboardInterrupt):
        RoundEngine(SPEC, FlakyFleet(fleet, 3), store=store).run()
    store.close()
    store = SqliteStore(tmp_path / "agg.sqlite")
    assert store.resume_point("speed")[0] == 4
    final = RoundEngine(SPEC, fleet, store=store).run()
    assert param_hash(final) == param_hash(clean)
    assert [r.round for r in store.rounds("speed")] == [1, 2, 3, 4, 5, 6]


class ScriptedFleet:
    def __init__(self, replies):
        self.replies = replies

    def collect(self, request):
        return self.replies(request)


def test_invalid_updates_are_rejected_and_thin_rounds_abandoned():
    def replies(req):
        good = {k: v.copy() for k, v in req.global_params.items()}
        nan = {k: np.full_like(v, np.nan) for k, v in req.global_params.items()}
        return [
            Update("a", good, 5),
            Update("a", good, 5),  # duplicate: ignored
            Update("b", nan, 5),
            Rejection("c", "malformed payload"),
        ]

    store = MemoryStore()
    engine = RoundEngine(SPEC, ScriptedFleet(replies), store=store, min_participants=2)
    start = engine.strategy.init_global()
    final = engine.run()
    assert all(r.status == "abandoned" for r in store.records)
    assert store.records[0].participants == ["a"]
    assert set(store.records[0].rejected) == {"b", "c"} and "NaN" in store.records[0].rejected["b"]
    assert param_hash(final) == param_hash(start)  # nothing aggregated from too few uploads

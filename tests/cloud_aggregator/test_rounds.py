"""The round engine: abandoned rounds, the store contract, and resuming to the same result."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.engine import MemoryStore, RoundEngine
from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet, simulate
from cloud_aggregator.rounds.types import Reason
from cloud_aggregator.store.sqlite import SqliteStore
from edge.config import DataConfig
from edge.simulated import simulated_printer_dataset
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


def test_invalid_uploads_are_refused_by_admission_and_thin_rounds_abandoned():
    def hostile(req, sent):
        (a, good), (b, honest_b), (c, _) = sent
        nan = dataclasses.replace(
            honest_b, params={k: np.full_like(v, np.nan) for k, v in honest_b.params.items()}
        )
        return [(a, good), (a, good), (b, nan), (c, b"\x00malformed payload")]

    fleet = SimulatedFleet(SPEC, printers(3), uplinks=hostile)
    store = MemoryStore()
    engine = RoundEngine(SPEC, fleet, store=store, min_participants=2)
    start = engine.strategy.init_global()
    final = engine.run()
    assert all(r.status == "abandoned" for r in store.records)
    assert store.records[0].participants == ["printer1"]
    assert set(store.records[0].rejected) == {"printer2", "printer3"}
    assert store.records[0].rejected["printer2"].startswith("non_finite")
    n = SPEC.rounds
    assert fleet.admission.refused == {
        "printer1": {Reason.RESENT: n},  # the second copy of the upload printer1 had answered with
        "printer2": {Reason.NON_FINITE: n},
        "printer3": {Reason.MALFORMED: n},
    }
    assert param_hash(final) == param_hash(start)  # nothing aggregated from too few uploads


def test_the_engine_refuses_a_fleet_that_returns_two_uploads_from_one_device():
    class TwiceFleet:
        def collect(self, request):
            return [Update("a", request.global_params, 5), Update("a", request.global_params, 5)]

    with pytest.raises(ValueError, match="two uploads from 'a'"):
        RoundEngine(SPEC, TwiceFleet()).run()


def test_memory_store_is_a_complete_round_store(tmp_path):
    """The in-process store answers every RoundStore method the SQLite store does."""
    sqlite = SqliteStore(tmp_path / "agg.sqlite")
    try:
        for store in (MemoryStore(), sqlite):
            engine = RoundEngine(SPEC, SimulatedFleet(SPEC, printers(2)), store=store)
            final = engine.run()
            records = store.rounds("speed")
            assert [r.round for r in records] == list(range(1, SPEC.rounds + 1))
            assert param_hash(store.get_params(records[-1].global_hash)) == param_hash(final)
            assert store.put_update("speed", 9, "train", "a", "g", b"x")
            assert not store.put_update("speed", 9, "train", "a", "g", b"y")
            assert store.stored_updates("speed", 9, "train", "g") == [("a", b"x")]
            store.put_rejection("speed", 9, "a", Reason.NORM, "too far")
            store.put_rejection("speed", 9, "a", Reason.REPLAY, "again")
            store.put_rejection("", None, "b", Reason.NO_ROUND, "no round open")
            assert store.rejection_counts_by_reason("speed") == {"a": {"norm": 1, "replay": 1}}
            assert store.rejection_counts() == {"a": 2, "b": 1}
    finally:
        sqlite.close()

"""Streaming aggregation: the fold's arithmetic, its checkpoints, and the round engine with it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cloud_aggregator.aggregation.mean import weighted_mean
from cloud_aggregator.aggregation.strategies import Strategy, make_strategy
from cloud_aggregator.aggregation.strategies.base import _STRATEGIES
from cloud_aggregator.aggregation.streaming import RoundFold, StreamingMean
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.engine import MemoryStore, RoundEngine
from cloud_aggregator.rounds.simulation import SimulatedFleet
from cloud_aggregator.store.sqlite import SqliteStore
from trainer_lite.task import TaskSpec

from .test_rounds import SPEC, printers


def uploads(n: int, p: int = 257, seed: int = 0) -> list[Update]:
    """``n`` float32 uploads of mixed magnitudes (where plain float64 sums depend on order)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        scale = 10.0 ** rng.integers(-6, 4)
        params = {
            "w": (rng.standard_normal(p) * scale).astype(np.float32),
            "b": rng.standard_normal(3).astype(np.float32),
        }
        out.append(Update(f"d{i:04d}", params, int(rng.integers(1, 500))))
    return out


def folded(ups: list[Update]) -> dict[str, np.ndarray]:
    fold = RoundFold(lambda u: float(u.n_samples))
    for u in ups:
        fold.add(u)
    return fold.mean.result()


def test_order_of_arrival_does_not_change_the_float32_result():
    ups = uploads(400)
    ref = folded(ups)
    rng = np.random.default_rng(1)
    for _ in range(5):
        got = folded([ups[i] for i in rng.permutation(len(ups))])
        for n in ref:
            assert got[n].dtype == np.float32
            np.testing.assert_array_equal(got[n], ref[n])
    # Against the exact sum (math.fsum, correctly rounded): the compensated fold matches it where a
    # plain float64 sum (the batch mean it replaces) loses digits to the mixed magnitudes.
    w = sum(float(u.n_samples) for u in ups)
    exact = np.array(
        [math.fsum(u.n_samples * float(u.params["w"][j]) for u in ups) / w for j in range(ref["w"].size)]
    ).astype(np.float32)
    np.testing.assert_array_equal(ref["w"], exact)
    batch = weighted_mean([(u.params, float(u.n_samples)) for u in ups])
    assert np.abs(batch["w"] - exact).max() >= np.abs(ref["w"] - exact).max()


def test_checkpoint_restores_the_sum_bit_for_bit():
    ups = uploads(60, seed=2)
    whole = RoundFold(lambda u: float(u.n_samples))
    half = RoundFold(lambda u: float(u.n_samples))
    for u in ups[:25]:
        whole.add(u)
        half.add(u)
    state = half.checkpoint()
    assert half.pending == {}
    resumed = RoundFold(lambda u: float(u.n_samples))
    resumed.restore(state, [u.device for u in ups[:25]])
    for u in ups[25:]:
        whole.add(u)
        resumed.add(u)
    a, b = whole.mean.state(), resumed.mean.state()
    assert a[1] == b[1]
    for n in a[0]:
        assert a[0][n].tobytes() == b[0][n].tobytes()
    with pytest.raises(ValueError, match="folded into this round already"):
        resumed.add(ups[0])


def test_fold_refuses_a_bad_upload_without_touching_the_sum():
    mean = StreamingMean()
    mean.add({"w": np.ones(3, np.float32)}, 2.0)
    with pytest.raises(ValueError, match="shape"):
        mean.add({"w": np.ones(4, np.float32)}, 1.0)
    with pytest.raises(ValueError, match="weight"):
        mean.add({"w": np.ones(3, np.float32)}, float("nan"))
    assert mean.count == 1
    np.testing.assert_array_equal(mean.result()["w"], np.ones(3, np.float32))


def test_which_strategies_stream():
    assert make_strategy(SPEC).fold("train") is not None  # PFL-DA's decoder mean
    for server in ({"reducer": "median"}, {"reducer": "krum"}, {"reducer": "trimmed_mean"}):
        spec = TaskSpec("t", "pflda", "sigmoid_glm", server=server)
        assert make_strategy(spec).fold("train") is None, server
    # Every other server needs a round's uploads at once (FedDAR, FedPP, PerPCA, FTL-TP, ...).
    folding = {name for name, cls in _STRATEGIES.items() if cls.fold is not Strategy.fold}
    assert folding == {"fedavg", "pfedme"}  # pFedMe: FedAvg's mean, then its β mixing


def test_engine_folds_uploads_as_admission_takes_them():
    """The simulator's rounds go through admission's fold: what the engine gets has no params,
    and the run ends where it ends with the fold forced off (same code otherwise).  The first
    round keeps its uploads whole: its weight cap needs the round's own median."""
    seen: list[list[Update]] = []

    class Watching(SimulatedFleet):
        def collect(self, request):
            out = super().collect(request)
            seen.append([u for u in out if isinstance(u, Update)])
            return out

    spec = dataclasses.replace(SPEC, rounds=3)
    streamed = RoundEngine(spec, Watching(spec, printers(3))).run()
    assert len(seen) == 3 and all(u.params for u in seen[0])
    assert all(u.params == {} for ups in seen[1:] for u in ups)

    class Batch(RoundEngine):
        def run_phase(self, round_, phase):
            fold = self.strategy.fold
            self.strategy.fold = lambda phase: None
            try:
                return super().run_phase(round_, phase)
            finally:
                self.strategy.fold = fold

    batch = Batch(spec, SimulatedFleet(spec, printers(3))).run()
    for n in streamed:
        np.testing.assert_allclose(streamed[n], batch[n], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("store_cls", [MemoryStore, SqliteStore])
def test_store_keeps_the_partial_and_drops_the_payloads_it_covers(tmp_path, store_cls):
    store = store_cls() if store_cls is MemoryStore else store_cls(tmp_path / "s.sqlite")
    for d in ("a", "b", "c"):
        store.put_update("t", 1, "train", d, "g", d.encode())
    store.put_partial("t", 1, "train", "g", b"sum-1", {"a": (5, {"loss": 1.0})})
    store.put_partial("t", 1, "train", "g", b"sum-2", {"b": (7, {})})
    assert store.partial("t", 1, "train", "other-global") is None
    state, who = store.partial("t", 1, "train", "g")
    assert state == b"sum-2" and who == {"a": (5, {"loss": 1.0}), "b": (7, {})}
    assert store.stored_updates("t", 1, "train", "g") == [("c", b"c")]

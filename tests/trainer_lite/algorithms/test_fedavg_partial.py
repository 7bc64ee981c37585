"""FedAvg with partial participation: only the sampled clients train, and the server averages them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet, simulate
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec


def _clients(n: int = 10) -> dict[str, ClientData]:
    rng = np.random.default_rng(0)
    out = {}
    for i in range(n):
        x = rng.normal(size=(10 + i, 1))
        out[f"d{i:02d}"] = ClientData(Dataset(x, 3.0 * x + 0.5))
    return out


def test_each_round_samples_the_requested_fraction():
    spec = TaskSpec(
        name="t", algorithm="fedavg", model="linear", hparams={"lr": 0.05}, dtype="float64", rounds=6
    )
    _, _fleet, records = simulate(spec, _clients(), participation=0.3)
    sets = [tuple(r.participants) for r in records]
    assert all(len(s) == 3 for s in sets)
    assert len(set(sets)) > 1  # a different sample in some rounds
    # The sample is a function of the task seed and the round: a rerun draws the same clients.
    again = SimulatedFleet(spec, _clients(), participation=0.3)
    assert [tuple(again.sample(r)) for r in range(1, 7)] == sets


def test_global_is_the_sample_weighted_mean_of_the_participants():
    spec = TaskSpec(
        name="t", algorithm="fedavg", model="linear", hparams={"lr": 0.05}, dtype="float64", rounds=1
    )
    seen = {}
    fleet = SimulatedFleet(spec, _clients(), participation=0.5)
    orig = fleet.collect

    def spy(request):
        ups = orig(replace(request, fold=None))  # whole uploads back; the engine folds them
        seen["ups"] = ups
        return ups

    fleet.collect = spy
    from cloud_aggregator.rounds.engine import RoundEngine

    final = RoundEngine(spec, fleet).run()
    ups = seen["ups"]
    assert len(ups) == 5
    w = np.array([u.n_samples for u in ups], dtype=float)
    for n in final:
        expected = sum(wi * u.params[n] for wi, u in zip(w, ups, strict=True)) / w.sum()
        np.testing.assert_allclose(final[n], expected)


def test_partial_participation_still_converges():
    spec = TaskSpec(
        name="t",
        algorithm="fedavg",
        model="linear",
        hparams={"optimizer": "sgd", "lr": 0.1},
        dtype="float64",
        rounds=80,
    )
    final, _, _ = simulate(spec, _clients(), participation=0.3)
    np.testing.assert_allclose(final["head.weight"][0, 0], 3.0, atol=1e-3)
    np.testing.assert_allclose(final["head.bias"][0], 0.5, atol=1e-3)

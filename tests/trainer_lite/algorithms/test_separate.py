"""Separate FedAvg per domain: each domain's model trains on that domain only and averages by its counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.strategies.separate import per_domain_mean
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import check_tensors
from cloud_aggregator.rounds.simulation import ClientData, simulate
from tests.budget import examples
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.feddar import COUNTS
from trainer_lite.algorithms.separate import domain_key
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

D, M = 4, 3


def _spec(algorithm: str = "separate_fedavg", rounds: int = 3, **hp) -> TaskSpec:
    hparams = {"optimizer": "sgd", "lr": 0.05, **hp}
    if algorithm == "separate_fedavg":
        hparams.setdefault("n_domains", M)
    return TaskSpec(
        name="t",
        algorithm=algorithm,
        model="linear",
        model_args={"d_in": D, "d_out": 1},
        hparams=hparams,
        dtype="float64",
        rounds=rounds,
        seed=4,
    )


def _maps(seed: int = 0) -> np.ndarray:
    """One linear map per domain: ``y = x · maps[domain]``."""
    return np.random.default_rng(seed).standard_normal((M, D))


def _data(rng: np.random.Generator, domains, maps: np.ndarray) -> Dataset:
    domains = np.asarray(domains)
    x = rng.standard_normal((len(domains), D))
    return Dataset(x, np.einsum("nd,nd->n", x, maps[domains])[:, None], domains)


def test_each_domain_model_trains_on_its_own_samples_only():
    rng = np.random.default_rng(0)
    spec = _spec()
    algo, strategy = make_client(spec), make_strategy(spec)
    g = strategy.init_global()
    data = _data(rng, [0, 0, 2, 0, 2], _maps())
    result, local = algo.update(g, {}, data, rng=rng, round_=1, phase="train")
    assert local == {}
    assert sorted(result.shared) == sorted(strategy.expected(g, "train"))
    assert check_tensors(result.shared, strategy.expected(g, "train")) is None
    np.testing.assert_array_equal(result.shared[COUNTS], [3, 0, 2])
    for name in algo.model_names():
        np.testing.assert_array_equal(result.shared[domain_key(1, name)], g[domain_key(1, name)])
    # Domain 0's copy is exactly FedAvg's local update on the domain-0 rows alone.
    ref_spec = _spec("fedavg")
    ref = make_client(ref_spec)
    only0 = data.take(np.flatnonzero(data.domain == 0))
    start = {n: g[domain_key(0, n)] for n in algo.model_names()}
    ref_out, _ = ref.update(start, {}, only0, rng=rng, round_=1, phase="train")
    for name in algo.model_names():
        np.testing.assert_allclose(result.shared[domain_key(0, name)], ref_out.shared[name], rtol=1e-12)


@settings(max_examples=examples(30), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    counts=st.lists(st.lists(st.integers(0, 4), min_size=M, max_size=M), min_size=1, max_size=5),
)
def test_per_domain_mean_weights_by_counts_and_keeps_unseen_domains(seed, counts):
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts, dtype=float)
    glob = {f"p{m}": rng.standard_normal(2) for m in range(M)}
    updates = [
        Update(f"d{i}", {f"p{m}": rng.standard_normal(2) for m in range(M)}, int(c.sum()))
        for i, c in enumerate(counts)
    ]
    out = per_domain_mean(glob, updates, counts, lambda m: [f"p{m}"])
    for m in range(M):
        total = counts[:, m].sum()
        want = (
            glob[f"p{m}"]
            if total == 0
            else sum(c * u.params[f"p{m}"] for c, u in zip(counts[:, m], updates, strict=True)) / total
        )
        np.testing.assert_allclose(out[f"p{m}"], want, rtol=1e-12, atol=1e-14)


def test_server_rejects_counts_that_do_not_add_up():
    spec = _spec()
    strategy = make_strategy(spec)
    g = strategy.init_global()
    params = {**{n: v for n, v in g.items()}, COUNTS: np.array([1.0, 1.0, 0.5])}
    with pytest.raises(ValueError, match="bad-device"):
        strategy.aggregate(g, [Update("bad-device", params, 2)], round_=1, phase="train")


def test_separate_fedavg_fits_one_model_per_domain():
    rng = np.random.default_rng(3)
    maps = _maps(3)
    clients = {}
    for i in range(9):
        main = i % M
        doms = rng.choice(M, 12, p=np.where(np.arange(M) == main, 0.8, 0.1))
        clients[f"c{i}"] = ClientData(_data(rng, doms, maps), _data(rng, rng.choice(M, 20), maps))

    def final_mse(spec: TaskSpec) -> float:
        g, fleet, _ = simulate(spec, clients)
        return float(np.mean([m["loss"] for m in fleet.evaluate(g).values()]))

    sep = final_mse(_spec(rounds=60, local_steps=5))
    avg = final_mse(_spec("fedavg", rounds=60, local_steps=5))
    assert sep < 1e-4
    assert avg > 100 * sep
    algo = make_client(_spec())
    with pytest.raises(ValueError, match="predict_domains"):
        algo.predict(make_strategy(_spec()).init_global(), {}, np.zeros((1, D)))

"""FedProx: all parameters shared, the proximal term's closed form, μ = 0 is FedAvg."""

from __future__ import annotations

import numpy as np

from cloud_aggregator.rounds.simulation import ClientData, simulate
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec


def _spec(algorithm: str = "fedprox", **hp) -> TaskSpec:
    return TaskSpec(name="t", algorithm=algorithm, model="linear", hparams=hp, dtype="float64", rounds=1)


def test_proximal_term_closed_form():
    """x = 0: ``(b − c)² + μ/2·(b − b_t)²`` is minimised at ``b = (2c + μ·b_t)/(2 + μ)``."""
    mu, c = 3.0, -0.8
    algo = make_client(_spec(mu=mu, optimizer="sgd", lr=0.05, local_steps=2000))
    rng = np.random.default_rng(0)
    shared = algo.init_global(rng)
    result, local = algo.update(
        shared, {}, Dataset(np.zeros((6, 1)), np.full((6, 1), c)), rng=rng, round_=1, phase="train"
    )
    assert local == {}
    assert sorted(result.shared) == ["head.bias", "head.weight"]
    b_t = shared["head.bias"][0]
    np.testing.assert_allclose(result.shared["head.bias"][0], (2 * c + mu * b_t) / (2 + mu), atol=1e-8)


def test_mu_zero_is_fedavg():
    data = Dataset(np.random.default_rng(1).normal(size=(10, 1)), np.ones((10, 1)))
    out = []
    for algorithm, hp in (("fedprox", {"mu": 0.0}), ("fedavg", {})):
        algo = make_client(_spec(algorithm, **hp))
        shared = algo.init_global(np.random.default_rng(2))
        result, _ = algo.update(shared, {}, data, rng=np.random.default_rng(3), round_=1, phase="train")
        out.append(result.shared)
    for n in out[0]:
        np.testing.assert_array_equal(out[0][n], out[1][n])


def test_fedprox_converges_on_a_shared_linear_model():
    rng = np.random.default_rng(0)
    clients = {}
    for i in range(4):
        x = rng.normal(size=(30, 1))
        clients[f"d{i}"] = ClientData(Dataset(x, 2.0 * x - 1.0))
    spec = TaskSpec(
        name="t",
        algorithm="fedprox",
        model="linear",
        hparams={"optimizer": "sgd", "lr": 0.1, "mu": 0.1},
        dtype="float64",
        rounds=60,
    )
    final, _, _ = simulate(spec, clients)
    np.testing.assert_allclose(final["head.weight"][0, 0], 2.0, atol=1e-3)
    np.testing.assert_allclose(final["head.bias"][0], -1.0, atol=1e-3)

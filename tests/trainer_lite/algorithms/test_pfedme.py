"""pFedMe: the Moreau-envelope personal model in closed form, the global step, the server's β."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec


def _spec(server=None, **hp) -> TaskSpec:
    return TaskSpec(
        name="t",
        algorithm="pfedme",
        model="linear",
        hparams=hp,
        server=server or {},
        dtype="float64",
        rounds=1,
    )


def test_personal_model_solves_the_moreau_envelope_problem():
    """x = 0, one local step with many inner steps: θ = (2c + λ·w)/(2 + λ); then w moves toward θ."""
    lam, c, eta = 4.0, 2.0, 0.05
    algo = make_client(_spec(lam=lam, inner_steps=3000, personal_lr=0.01, local_steps=1, lr=eta))
    rng = np.random.default_rng(0)
    shared = algo.init_global(rng)
    data = Dataset(np.zeros((5, 1)), np.full((5, 1), c))
    result, local = algo.update(shared, {}, data, rng=rng, round_=1, phase="train")
    w = shared["head.bias"][0]
    theta = (2 * c + lam * w) / (2 + lam)
    np.testing.assert_allclose(local["personal.head.bias"][0], theta, atol=1e-8)
    np.testing.assert_allclose(result.shared["head.bias"][0], w - eta * lam * (w - theta), atol=1e-8)
    assert sorted(result.shared) == ["head.bias", "head.weight"]
    assert algo.personal_params(shared, local)["head.bias"] is local["personal.head.bias"]


@pytest.mark.parametrize("beta", [1.0, 2.0, 0.5])
def test_server_mixes_with_beta(beta):
    strategy = make_strategy(_spec(server={"weighting": "uniform", "beta": beta}))
    g = {"head.weight": np.zeros((1, 1)), "head.bias": np.array([1.0])}
    ups = [
        Update("a", {"head.weight": np.ones((1, 1)), "head.bias": np.array([3.0])}, 1),
        Update("b", {"head.weight": 3 * np.ones((1, 1)), "head.bias": np.array([5.0])}, 1),
    ]
    out = strategy.aggregate(g, ups, round_=1, phase="train")
    np.testing.assert_allclose(out["head.bias"], [(1 - beta) * 1.0 + beta * 4.0])
    np.testing.assert_allclose(out["head.weight"], [[beta * 2.0]])


def test_invalid_beta_is_rejected():
    with pytest.raises(ValueError, match="beta"):
        make_strategy(_spec(server={"beta": 0.0}))

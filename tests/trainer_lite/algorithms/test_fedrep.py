"""FedRep: head steps with the body frozen, then body steps with the new head; only the body leaves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.simulation import ClientData, simulate
from tests.budget import examples
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.base import loss_and_grads
from trainer_lite.data import Dataset
from trainer_lite.losses import mse
from trainer_lite.task import TaskSpec

D, K = 6, 2


def _spec(algorithm: str = "fedrep", rounds: int = 3, **hp) -> TaskSpec:
    return TaskSpec(
        name="t",
        algorithm=algorithm,
        model="linear_rep",
        model_args={"d_in": D, "k": K},
        hparams={"optimizer": "sgd", "lr": 0.05, **hp},
        dtype="float64",
        rounds=rounds,
        seed=2,
    )


def _client(rng: np.random.Generator, b: np.ndarray, n: int) -> Dataset:
    """FedRep's own setting: a shared representation B and one head per client."""
    x = rng.standard_normal((n, D))
    return Dataset(x, x @ b @ rng.standard_normal((K, 1)))


def test_only_the_body_leaves_and_the_head_stays():
    algo = make_client(_spec())
    assert algo.shared_names() == ["encoder.weight"]
    assert algo.personal_names() == ["head.weight"]
    rng = np.random.default_rng(0)
    g, local = algo.init_global(rng), algo.init_local(rng)
    b, _ = np.linalg.qr(rng.standard_normal((D, K)))
    result, new_local = algo.update(g, local, _client(rng, b, 8), rng=rng, round_=1, phase="train")
    assert sorted(result.shared) == ["encoder.weight"]
    assert sorted(new_local) == ["head.weight"]
    assert not np.allclose(new_local["head.weight"], local["head.weight"])
    assert not np.allclose(result.shared["encoder.weight"], g["encoder.weight"])


@settings(max_examples=examples(15), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), head_steps=st.integers(1, 6), body_steps=st.integers(1, 6))
def test_head_steps_then_body_steps_in_that_order(seed, head_steps, body_steps):
    """The same update written out by hand: SGD on the head with the body fixed, then on the body."""
    rng = np.random.default_rng(seed)
    algo = make_client(_spec(head_steps=head_steps, local_steps=body_steps, head_lr=0.1, lr=0.03))
    g, local = algo.init_global(rng), algo.init_local(rng)
    b, _ = np.linalg.qr(rng.standard_normal((D, K)))
    data = _client(rng, b, 7)
    result, new_local = algo.update(g, local, data, rng=rng, round_=1, phase="train")
    p = {**{k: v.copy() for k, v in g.items()}, **{k: v.copy() for k, v in local.items()}}
    for _ in range(head_steps):
        _, grads = loss_and_grads(algo.model, p, data, mse)
        p["head.weight"] = p["head.weight"] - 0.1 * grads["head.weight"]
    for _ in range(body_steps):
        _, grads = loss_and_grads(algo.model, p, data, mse)
        p["encoder.weight"] = p["encoder.weight"] - 0.03 * grads["encoder.weight"]
    np.testing.assert_allclose(result.shared["encoder.weight"], p["encoder.weight"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(new_local["head.weight"], p["head.weight"], rtol=1e-12, atol=1e-14)


def test_server_is_the_sample_weighted_mean_of_the_bodies():
    spec = _spec()
    strategy = make_strategy(spec)
    g = strategy.init_global()
    a, c = np.full((D, K), 1.0), np.full((D, K), 4.0)
    new = strategy.aggregate(
        g,
        [Update("a", {"encoder.weight": a}, 1), Update("c", {"encoder.weight": c}, 3)],
        round_=1,
        phase="train",
    )
    np.testing.assert_allclose(new["encoder.weight"], np.full((D, K), 3.25))


def test_fedrep_learns_client_heads_on_a_shared_representation_where_fedavg_cannot():
    rng = np.random.default_rng(5)
    b, _ = np.linalg.qr(rng.standard_normal((D, K)))
    clients = {}
    for i in range(12):
        head = rng.standard_normal((K, 1))
        x, xt = rng.standard_normal((12, D)), rng.standard_normal((30, D))
        clients[f"c{i:02d}"] = ClientData(Dataset(x, x @ b @ head), Dataset(xt, xt @ b @ head))

    def final_mse(spec: TaskSpec) -> float:
        g, fleet, _ = simulate(spec, clients)
        return float(np.mean([m["loss"] for m in fleet.evaluate(g).values()]))

    rep = final_mse(_spec(rounds=80, head_steps=10, head_lr=0.2, local_steps=5, lr=0.05))
    avg = final_mse(_spec("fedavg", rounds=80, local_steps=5, lr=0.05))
    assert rep < 1e-3
    assert avg > 50 * rep


def test_config_errors():
    with pytest.raises(ValueError, match="head_steps"):
        make_client(_spec(head_steps=0))
    with pytest.raises(ValueError, match="head_lr"):
        make_client(_spec(head_lr=-1.0))

"""PFL-DA and Simple-DA clients: what leaves the device, both pulls, the centring term, convergence."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_aggregator.rounds.simulation import ClientData, mean_test_loss, simulate
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.base import loss_and_grads
from trainer_lite.algorithms.pflda import PERSONAL, centered_loss_and_grads
from trainer_lite.data import Dataset
from trainer_lite.layers import Affine, Linear, Sequential
from trainer_lite.losses import mse
from trainer_lite.models import build_model
from trainer_lite.params import strip_prefix
from trainer_lite.task import TaskSpec


def _spec(algorithm: str = "pflda", model: str = "sigmoid_glm", **hp) -> TaskSpec:
    return TaskSpec(name="t", algorithm=algorithm, model=model, hparams=hp, dtype="float64", rounds=1)


def _data(seed: int = 0, n: int = 20, shift: float = 0.0) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 2.0, (n, 1))
    return Dataset(x, 1.0 / (1.0 + np.exp(-(2.0 * x - 2.0 + shift))))


def _round(algo, data, seed=0, round_=1):
    rng = np.random.default_rng(seed)
    shared = algo.init_global(rng)
    local = algo.init_local(rng)
    result, new_local = algo.update(shared, local, data, rng=rng, round_=round_, phase="train")
    return shared, local, result, new_local


@pytest.mark.parametrize("pull", ["convex", "gradient"])
def test_only_the_decoder_leaves_the_device(pull):
    algo = make_client(_spec(pull=pull))
    shared, _local, result, new_local = _round(algo, _data())
    assert sorted(result.shared) == ["decoder.bias", "decoder.weight"] == algo.shared_names()
    # Local state: the encoder β and the personal decoder γ, neither of which is uploaded.
    assert sorted(new_local) == [
        "encoder.scale",
        "encoder.shift",
        "personal.decoder.bias",
        "personal.decoder.weight",
    ]
    for n, v in result.shared.items():
        assert not np.allclose(v, new_local[f"{PERSONAL}.{n}"])
        assert not np.allclose(v, shared[n])  # it did train


def test_update_never_mutates_its_inputs():
    algo = make_client(_spec())
    rng = np.random.default_rng(1)
    shared, local = algo.init_global(rng), algo.init_local(rng)
    before = {k: v.copy() for k, v in {**shared, **local}.items()}
    algo.update(shared, local, _data(), rng=rng, round_=1, phase="train")
    for k, v in {**shared, **local}.items():
        np.testing.assert_array_equal(v, before[k])


def test_convex_pull_with_lambda_one_pins_gamma_to_the_round_start_global():
    algo = make_client(_spec(lam=1.0, pull="convex", local_steps=5))
    shared, _, _, new_local = _round(algo, _data())
    gamma = strip_prefix(new_local, PERSONAL)
    for n in shared:
        np.testing.assert_array_equal(gamma[n], shared[n])


def test_convex_pull_at_first_leaves_later_steps_free():
    every = make_client(_spec(lam=1.0, pull_at="every", local_steps=4))
    first = make_client(_spec(lam=1.0, pull_at="first", local_steps=4))
    shared, _, _, local_every = _round(every, _data())
    _, _, _, local_first = _round(first, _data())
    g_first = strip_prefix(local_first, PERSONAL)
    assert not np.allclose(g_first["decoder.bias"], shared["decoder.bias"])
    # The encoders are trained identically (the pull only touches γ).
    np.testing.assert_allclose(local_first["encoder.shift"], local_every["encoder.shift"])


def test_convex_pull_is_the_weighted_average_after_each_step():
    """One step with λ: γ' = λ·w + (1 − λ)·(γ − Adam step), reproduced by hand."""
    lam = 0.3
    algo = make_client(_spec(lam=lam, local_steps=1, optimizer="sgd", lr=0.1))
    data = _data()
    shared, local, _result, new_local = _round(algo, data)
    # γ's SGD step uses the encoder after its own step (the uploaded round's encoder).
    enc = {n: new_local[n] for n in ("encoder.scale", "encoder.shift")}
    gamma0 = strip_prefix(local, PERSONAL)
    _, g = loss_and_grads(algo.model, {**enc, **gamma0}, data, mse)
    expected = {n: lam * shared[n] + (1 - lam) * (gamma0[n] - 0.1 * g[n]) for n in gamma0}
    for n, v in strip_prefix(new_local, PERSONAL).items():
        np.testing.assert_allclose(v, expected[n], rtol=1e-12)


def test_gradient_pull_solves_the_ridge_problem_of_algorithm_3():
    """Algorithm 3's γ reaches the closed-form ridge solution.

    With a linear decoder ``ŷ = φ·W + b`` and every ``φ = shift`` the regularised
    loss ``(a·u − c)² + λ‖u − w‖²`` (``a = (φ, 1)``, ``u = (W, b)``) has minimiser
    ``u* = w + a·(c − a·w)/(λ + a·a)``; many small SGD steps of Algorithm 3 reach it.
    """
    lam, c = 0.7, 0.4
    algo = make_client(_spec(pull="gradient", lam=lam, optimizer="sgd", lr=0.02, local_steps=3000))
    # A model no fleet trains, so it is built here rather than registered in trainer_lite.models.
    algo.model = Sequential([("encoder", Affine(1)), ("decoder", Linear(1, 1))])
    data = Dataset(np.zeros((8, 1)), np.full((8, 1), c))
    rng = np.random.default_rng(3)
    shared, local = algo.init_global(rng), algo.init_local(rng)
    _, new_local = algo.update(shared, local, data, rng=rng, round_=1, phase="train")
    a = np.array([local["encoder.shift"][0], 1.0])  # Algorithm 3 uses the round's starting β
    w = np.array([shared["decoder.weight"][0, 0], shared["decoder.bias"][0]])
    expected = w + a * (c - a @ w) / (lam + a @ a)
    got = np.array([new_local["personal.decoder.weight"][0, 0], new_local["personal.decoder.bias"][0]])
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_feature_centring_gradient_matches_finite_differences():
    model = build_model("printer_nn", feature_dim=3, encoder_hidden=4, width=5, depth=2)
    rng = np.random.default_rng(0)
    params = model.init(rng)
    data = Dataset(rng.uniform(0.5, 2.0, (7, 1)), rng.uniform(0.0, 1.0, (7, 1)))
    value, grads = centered_loss_and_grads(model, params, data, mse, 0.5, "encoder")
    for name in ("encoder.shortcut.bias", "encoder.body.fc1.weight", "decoder.fc0.weight"):
        p = params[name]
        idx = (0,) * p.ndim
        eps = 1e-6
        plus = {**params, name: p.copy()}
        plus[name][idx] += eps
        minus = {**params, name: p.copy()}
        minus[name][idx] -= eps
        fd = (
            centered_loss_and_grads(model, plus, data, mse, 0.5, "encoder")[0]
            - centered_loss_and_grads(model, minus, data, mse, 0.5, "encoder")[0]
        ) / (2 * eps)
        np.testing.assert_allclose(grads[name][idx], fd, rtol=1e-5, atol=1e-9)
    # The term is really there: its weight changes the loss.
    assert value > centered_loss_and_grads(model, params, data, mse, 0.0, "encoder")[0]


def test_simple_da_predicts_with_the_shared_decoder():
    algo = make_client(_spec("simple_da"))
    _shared, _, result, new_local = _round(algo, _data())
    assert sorted(new_local) == ["encoder.scale", "encoder.shift"]
    assert sorted(result.shared) == algo.shared_names()
    pp = algo.personal_params(result.shared, new_local)
    for n in algo.shared_names():
        assert pp[n] is result.shared[n]


def test_pflda_learns_covariate_shifted_clients():
    """Each client's input is shifted; PFL-DA's personal encoders absorb the shift."""
    clients = {}
    for i, shift in enumerate((-1.0, -0.3, 0.4, 1.1)):
        clients[f"d{i}"] = ClientData(_data(i, 30, shift), _data(10 + i, 30, shift))
    spec = TaskSpec(
        name="t", algorithm="pflda", model="sigmoid_glm", hparams={"lr": 0.05}, dtype="float64", rounds=40
    )
    final, fleet, records = simulate(spec, clients)
    first = np.mean([m["test_loss"] for m in records[0].metrics.values()])
    assert mean_test_loss(fleet, final) < 0.05 * first
    assert mean_test_loss(fleet, final) < 2e-3

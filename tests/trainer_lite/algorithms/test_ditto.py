"""Ditto: the global copy is uploaded, the personal model never; the paper's and the authors' pulls."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_aggregator.rounds.simulation import ClientData, mean_test_loss, simulate
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.pflda import PERSONAL
from trainer_lite.data import Dataset
from trainer_lite.params import strip_prefix
from trainer_lite.task import TaskSpec


def _spec(model: str = "sigmoid_glm", **hp) -> TaskSpec:
    return TaskSpec(name="t", algorithm="ditto", model=model, hparams=hp, dtype="float64", rounds=1)


def _data(seed: int = 0, n: int = 16, offset: float = 0.0) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 2.0, (n, 1))
    return Dataset(x, np.tanh(x) + offset)


def _round(algo, data, seed=0):
    rng = np.random.default_rng(seed)
    shared, local = algo.init_global(rng), algo.init_local(rng)
    result, new_local = algo.update(shared, local, data, rng=rng, round_=1, phase="train")
    return shared, local, result, new_local


def test_uploads_the_global_copy_and_keeps_the_personal_model():
    algo = make_client(_spec())
    shared, _local, result, new_local = _round(algo, _data())
    assert sorted(result.shared) == algo.shared_names() == sorted(shared)
    assert all(k.startswith(PERSONAL + ".") for k in new_local)
    personal = strip_prefix(new_local, PERSONAL)
    for n in shared:
        assert not np.allclose(result.shared[n], personal[n])


def test_gradient_pull_reaches_the_closed_form_personal_model():
    """x = 0 makes ``F(v) = (b − c)²``: the personal bias solves ``2(b − c) + λ(b − w) = 0``."""
    lam, c = 0.5, 1.3
    algo = make_client(_spec("linear", lam=lam, optimizer="sgd", lr=0.05, local_steps=2000))
    data = Dataset(np.zeros((5, 1)), np.full((5, 1), c))
    shared, _, result, new_local = _round(algo, data)
    w = shared["head.bias"][0]
    np.testing.assert_allclose(new_local["personal.head.bias"][0], (2 * c + lam * w) / (2 + lam), atol=1e-8)
    # The weight sees no data gradient (x = 0): only the pull, so it converges to w's weight.
    np.testing.assert_allclose(new_local["personal.head.weight"], shared["head.weight"], atol=1e-8)
    # The global copy is plain local training: its bias goes to c.
    np.testing.assert_allclose(result.shared["head.bias"][0], c, atol=1e-6)


def test_authors_convex_pull_pins_the_personal_decoder_and_the_global_encoder():
    """λ = 1 in the authors' form: personal decoder = w^t, uploaded encoder = w^t, the rest trains."""
    algo = make_client(
        _spec(lam=1.0, pull="convex", personal_pull=["decoder"], global_pull=["encoder"], local_steps=5)
    )
    shared, local, result, new_local = _round(algo, _data())
    personal = strip_prefix(new_local, PERSONAL)
    for n in ("decoder.weight", "decoder.bias"):
        np.testing.assert_array_equal(personal[n], shared[n])
        assert not np.allclose(result.shared[n], shared[n])
    for n in ("encoder.scale", "encoder.shift"):
        np.testing.assert_array_equal(result.shared[n], shared[n])
        assert not np.allclose(personal[n], local[f"{PERSONAL}.{n}"])


def test_global_optimizer_sgd_trains_the_global_copy_with_plain_steps():
    lr = 0.1
    algo = make_client(_spec("linear", global_optimizer="sgd", lr=lr, local_steps=1))
    data = Dataset(np.ones((4, 1)), np.full((4, 1), 2.0))
    shared, _, result, _ = _round(algo, data)
    pred = shared["head.weight"][0, 0] + shared["head.bias"][0]
    grad = 2 * (pred - 2.0)
    np.testing.assert_allclose(result.shared["head.bias"][0], shared["head.bias"][0] - lr * grad)


@pytest.mark.parametrize(
    "bad", [{"pull": "gradient", "global_pull": ["encoder"]}, {"pull": "convex", "lam": 1.5}]
)
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        make_client(_spec(**bad))


def test_personal_models_fit_their_own_clients():
    clients = {f"d{i}": ClientData(_data(i, offset=0.3 * i), _data(10 + i, offset=0.3 * i)) for i in range(3)}
    spec = TaskSpec(
        name="t",
        algorithm="ditto",
        model="sigmoid_glm",
        hparams={"lr": 0.05, "lam": 0.1},
        dtype="float64",
        rounds=40,
    )
    final, fleet, records = simulate(spec, clients)
    first = np.mean([m["test_loss"] for m in records[0].metrics.values()])
    assert mean_test_loss(fleet, final) < 0.05 * first

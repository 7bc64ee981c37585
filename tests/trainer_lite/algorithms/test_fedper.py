"""FedPer and LG-FedAvg: which blocks leave the device, and which stay."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_aggregator.rounds.simulation import ClientData, mean_test_loss, simulate
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec


def _spec(algorithm: str, model: str = "sigmoid_glm", model_args=None, **hp) -> TaskSpec:
    return TaskSpec(
        name="t", algorithm=algorithm, model=model, model_args=model_args or {}, hparams=hp, dtype="float64"
    )


def _data(seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 2, (20, 1))
    return Dataset(x, 1 / (1 + np.exp(-(x - 1 + 0.3 * seed))))


@pytest.mark.parametrize(
    ("algorithm", "shared", "personal"),
    [
        ("fedper", ["encoder.scale", "encoder.shift"], ["decoder.bias", "decoder.weight"]),
        ("lgfedavg", ["decoder.bias", "decoder.weight"], ["encoder.scale", "encoder.shift"]),
    ],
)
def test_default_split_and_what_is_uploaded(algorithm, shared, personal):
    algo = make_client(_spec(algorithm))
    assert algo.shared_names() == shared
    rng = np.random.default_rng(0)
    g, local = algo.init_global(rng), algo.init_local(rng)
    assert sorted(g) == shared and sorted(local) == personal
    result, new_local = algo.update(g, local, _data(0), rng=rng, round_=1, phase="train")
    assert sorted(result.shared) == shared
    assert sorted(new_local) == personal
    for n in personal:
        assert not np.allclose(new_local[n], local[n])
    pp = algo.personal_params(result.shared, new_local)
    assert sorted(pp) == sorted(shared + personal)


def test_mlp_default_head_is_the_last_linear_layer():
    fedper = make_client(_spec("fedper", "mlp", {"sizes": [3, 4, 2]}))
    lg = make_client(_spec("lgfedavg", "mlp", {"sizes": [3, 4, 2]}))
    assert fedper.personal_names() == ["fc1.bias", "fc1.weight"]
    assert lg.shared_names() == ["fc1.bias", "fc1.weight"]


def test_explicit_personal_blocks_and_errors():
    algo = make_client(_spec("fedper", "mlp", {"sizes": [3, 4, 4, 2]}, personal_blocks=["fc1", "fc2"]))
    assert algo.shared_names() == ["fc0.bias", "fc0.weight"]
    with pytest.raises(ValueError, match="at least two blocks"):
        make_client(_spec("fedper", "linear")).shared_names()


def test_lgfedavg_converges_with_personal_encoders():
    clients = {f"d{i}": ClientData(_data(i), _data(i)) for i in range(4)}
    spec = TaskSpec(
        name="t", algorithm="lgfedavg", model="sigmoid_glm", hparams={"lr": 0.05}, dtype="float64", rounds=40
    )
    final, fleet, records = simulate(spec, clients)
    first = np.mean([m["test_loss"] for m in records[0].metrics.values()])
    assert mean_test_loss(fleet, final) < 0.05 * first

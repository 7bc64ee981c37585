"""Explicit wiring: each client algorithm names its server strategy; unknown names list the choices."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.strategies.base import strategy_class
from trainer_lite.algorithms.base import ClientAlgorithm, algorithm_names, client_class, register_client
from trainer_lite.algorithms.fedavg import FedAvgClient
from trainer_lite.data import Dataset
from trainer_lite.models import build_model, model_names
from trainer_lite.task import TaskSpec


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_client_names_a_registered_strategy_in_its_own_class_body(algorithm):
    cls = client_class(algorithm)
    assert "server" in cls.__dict__
    assert strategy_class(algorithm).name == cls.server


def test_the_strategy_a_spec_resolves_to_is_the_one_its_client_names():
    spec = TaskSpec(name="t", algorithm="pfedme", model="linear", model_args={"d_in": 2})
    assert type(make_strategy(spec)).name == "pfedme"  # not FedAvg, which PFedMeClient inherits from


def test_an_unknown_algorithm_lists_the_valid_ones_in_one_line():
    spec = TaskSpec(name="t", algorithm="fedsgd", model="linear")
    with pytest.raises(ValueError, match=r"unknown algorithm 'fedsgd'; choose one of \[.*'fedavg'") as err:
        make_strategy(spec)
    assert "\n" not in str(err.value)


def test_a_client_must_name_its_server_itself():
    class Inherits(FedAvgClient):
        name = "inherits_fedavg_server"

    with pytest.raises(TypeError, match="must name its server strategy"):
        register_client(Inherits)
    assert "inherits_fedavg_server" not in algorithm_names()


def test_the_models_algorithms_need_are_listed_with_the_others():
    assert {"vector", "linear_rep"} <= set(model_names())
    params = build_model("linear_rep", d_in=3, k=2).init(np.random.default_rng(0))
    assert sorted(params) == ["encoder.weight", "head.weight"]
    assert build_model("vector", size=4).init(np.random.default_rng(0))["v.value"].shape == (4,)


def test_local_steps_defaults_to_the_config_and_model():
    spec = TaskSpec(name="t", algorithm="fedavg", model="linear", hparams={"local_steps": 3, "lr": 0.1})
    algo = client_class("fedavg")(spec)
    assert isinstance(algo, ClientAlgorithm)
    x = np.random.default_rng(1).normal(size=(8, 1))
    data = Dataset(x, 2 * x)
    params = algo.init_global(np.random.default_rng(0))
    before = {n: v.copy() for n, v in params.items()}
    loss = algo.local_steps(params, data, np.random.default_rng(2), round_=1)
    assert np.isfinite(loss)
    assert all(not np.array_equal(params[n], before[n]) for n in params)

"""`[task.secagg]` in the aggregator TOML: the README's example validates, and tasks SecAgg cannot
serve are refused at start-up with a line that says what to change."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies.fedavg import FedAvg
from cloud_aggregator.config import AggregatorConfig
from ioft_protocol.config import ConfigError, build
from ioft_protocol.secagg import SecAggConfig
from ioft_protocol.secagg.transport import change, device_weight, flatten, unflatten
from tests.e2e.test_secagg_fleet import readme_secagg_task
from trainer_lite.task import TaskSpec


def _config(task: dict, **top) -> AggregatorConfig:
    return build(
        AggregatorConfig, {"fleet": "plant-a", "allow_plaintext": True, **top, "task": [task]}, "test"
    )


def test_the_readme_example_reaches_the_task_spec():
    (task,) = _config(readme_secagg_task()).task
    assert task.secagg == SecAggConfig(threshold=0.6, degree=0, clip=4.0, bits=20)
    spec = TaskSpec.from_json(task.spec().to_json())  # what devices get in the announcement
    assert SecAggConfig.from_json(spec.secagg) == task.secagg
    assert "secagg" not in TaskSpec("t", "fedavg", "mlp").to_json()  # specs without it are unchanged


@pytest.mark.parametrize(
    ("change_", "why"),
    [
        ({"server": {"weighting": "uniform", "reducer": "median"}}, "reducer must be 'mean'"),
        ({"dp": {"mode": "central", "devices_per_round": 4}}, "dp mode 'distributed'"),
        ({"secagg": {"threshold": 0.3}}, "threshold"),
        ({"secagg": {"clip": 1.0, "bitz": 8}}, "bitz"),
    ],
)
def test_tasks_secagg_cannot_serve_are_refused_naming_the_fix(change_, why):
    task = {**readme_secagg_task(), **change_}
    with pytest.raises((ValueError, ConfigError), match=why):
        _config(task)


def test_a_strategy_that_is_not_a_mean_is_refused():
    task = {"name": "w", "algorithm": "pfedme", "model": "mlp", "model_args": {"sizes": [8, 4, 2]}}
    with pytest.raises((ValueError, ConfigError), match="mean-family"):
        _config({**task, "secagg": {"clip": 1.0}})


def test_the_strategy_declares_whether_secagg_can_serve_it(monkeypatch):
    # Its capability decides, not its name: FedAvg declared without it is refused like pfedme.
    _config(readme_secagg_task())
    monkeypatch.setattr(FedAvg, "secagg", False)
    with pytest.raises((ValueError, ConfigError), match="mean-family"):
        _config(readme_secagg_task())


def test_late_uploads_are_refused_with_secagg():
    with pytest.raises((ValueError, ConfigError), match="straggler = 'drop'"):
        _config(readme_secagg_task(), collect={"straggler": "next_round"})


def test_the_update_vector_round_trips_and_weights_follow_the_weighting():
    g = {"b": np.zeros(2, np.float32), "a": np.ones((2, 3), np.float32)}
    u = {"a": np.full((2, 3), 1.5, np.float32), "b": np.array([0.25, -1], np.float32)}
    d = change(u, g)
    assert d.tolist() == [0.5] * 6 + [0.25, -1.0]  # sorted names: a, then b
    assert {k: v.tolist() for k, v in unflatten(flatten(g) + d, g).items()} == {
        k: v.tolist() for k, v in u.items()
    }
    assert device_weight({"weighting": "uniform"}, 40) == 1.0 and device_weight({}, 40) == 40.0
    with pytest.raises(ValueError, match="weighting"):
        device_weight({"weighting": "fairness"}, 40)

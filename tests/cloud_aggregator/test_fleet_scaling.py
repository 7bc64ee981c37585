"""A task's ``scaling = "fleet"``: the pooling, the two messages and the aggregator's pool."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet
from cloud_aggregator.serve.fleet_scaling import ScalingPool
from ioft_protocol import topics
from ioft_protocol.codec import WireError
from ioft_protocol.feature_stats import MIN_STATS_ROWS, FeatureStats, FleetScaling
from sensors.features.scaling import Standardizer, feature_sums, pool_feature_sums
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

RNG = np.random.default_rng(0)
ROWS = {f"d{i}": RNG.normal(i, 1.0 + i, size=(12 + i, 5)) * 10.0**i for i in range(4)}


def _spec(**hparams) -> TaskSpec:
    return TaskSpec.from_json(
        json.dumps({"name": "tool", "algorithm": "fedavg", "model": "mlp", "rounds": 2,
                    "model_args": {"sizes": [5, 3]}, "hparams": {"scaling": "fleet", **hparams}})
    )  # fmt: skip


def _stats(device: str, x: np.ndarray, task: str = "tool") -> bytes:
    return FeatureStats(task, device, *feature_sums(x)).encode()


def test_pooled_sums_equal_the_statistics_of_all_rows():
    pooled = pool_feature_sums({d: feature_sums(x) for d, x in ROWS.items()}, 3)
    direct = Standardizer.fit(np.concatenate(list(ROWS.values())))
    np.testing.assert_allclose(pooled.mean, direct.mean, rtol=1e-12)
    np.testing.assert_allclose(pooled.std, direct.std, rtol=1e-9)


def test_pooling_refuses_fewer_devices_than_asked_and_mixed_widths():
    two = {d: feature_sums(ROWS[d]) for d in ("d0", "d1")}
    with pytest.raises(ValueError, match="at least 3 devices' statistics; have 2 \\(d0, d1\\)"):
        pool_feature_sums(two, 3)
    mixed = two | {"d2": feature_sums(ROWS["d2"][:, :4])}
    with pytest.raises(ValueError, match="different widths"):
        pool_feature_sums(mixed, 3)


def test_a_task_cannot_ask_to_pool_fewer_than_three_devices():
    assert make_client(_spec()).scaling_min_devices == 3
    with pytest.raises(ValueError, match="scaling_min_devices=2: an integer >= 3"):
        make_client(_spec(scaling_min_devices=2))


def test_the_messages_round_trip_exactly_and_refuse_what_reveals_rows():
    msg = FeatureStats.decode(_stats("d1", ROWS["d1"]))
    n, total, sumsq = feature_sums(ROWS["d1"])
    assert msg.n == n and np.array_equal(msg.sum, total) and np.array_equal(msg.sumsq, sumsq)
    with pytest.raises(WireError, match=f"'n' must be an integer >= {MIN_STATS_ROWS}"):
        FeatureStats.decode(_stats("d1", ROWS["d1"][:2]))
    few = FleetScaling("tool", ("d0", "d1"), 20, np.zeros(5), np.ones(5)).encode()
    with pytest.raises(WireError, match="pooled from 2 devices; at least 3"):
        FleetScaling.decode(few)


def test_the_pool_publishes_once_at_the_minimum_and_then_stays_frozen():
    sent: list[tuple[str, bytes]] = []
    pool = ScalingPool(
        "f", lambda t, p: sent.append((t, p)), lambda task, d: "held out" if d == "h" else None
    )
    pool.task(_spec(scaling_min_devices=3))
    pool.handle("tool", "h", _stats("h", ROWS["d3"]))  # a held-out device: refused
    pool.handle("tool", "d0", _stats("d0", ROWS["d0"]))
    pool.handle("tool", "d1", _stats("d1", ROWS["d1"]))
    pool.handle("tool", "d2", _stats("d2", ROWS["d2"][:, :4]))  # another width: refused
    pool.handle("tool", "d2", _stats("d1", ROWS["d2"]))  # another device's name inside: refused
    assert sent == [] and set(pool.refused["tool"]) == {"h", "d2"}
    pool.handle("tool", "d2", _stats("d2", ROWS["d2"]))
    assert [t for t, _ in sent] == [topics.topic_scaling("f", "tool")]
    published = FleetScaling.decode(sent[0][1])
    want = Standardizer.fit(np.concatenate([ROWS[d] for d in ("d0", "d1", "d2")]))
    np.testing.assert_allclose(published.mean, want.mean, rtol=1e-12)
    assert published.devices == ("d0", "d1", "d2") and published.rows == sum(
        len(ROWS[d]) for d in ("d0", "d1", "d2")
    )
    pool.handle("tool", "d3", _stats("d3", ROWS["d3"]))  # after publication: refused, nothing changes
    assert len(sent) == 1 and "frozen" in pool.refused["tool"]["d3"]
    pool.republish()
    assert sent[1] == sent[0]


def test_the_simulator_trains_every_client_through_the_pooled_transform():
    clients = {d: ClientData(Dataset(x, np.zeros((len(x), 3))), None) for d, x in ROWS.items()}
    fleet = SimulatedFleet(_spec(), clients)
    pooled = pool_feature_sums({d: feature_sums(x) for d, x in ROWS.items()}, 3)
    for d, x in ROWS.items():
        np.testing.assert_array_equal(fleet.clients[d].train.x, pooled.transform(x, np.float64))

"""A task's ``scaling = "fleet"``: the pooling, the two messages and the aggregator's pool."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet
from cloud_aggregator.serve.fleet_scaling import ScalingPool
from ioft_protocol import topics
from ioft_protocol.codec import WireError
from ioft_protocol.feature_stats import MIN_STATS_ROWS, FeatureStats, FleetScaling
from sensors.features.scaling import CLIP_RATIO, Standardizer, feature_sums, pool_feature_sums, sums_refusal
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

RNG = np.random.default_rng(0)
# One process on four machines: each device's mean and deviation near the others' (the pool clips
# a device that strays far from the median device; see the liar tests below).
ROWS = {f"d{i}": RNG.normal(5.0, 2.0, size=(12 + i, 5)) * [1.0, 1e-3, 1e3, 10.0, 1e-8] for i in range(4)}


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


def test_sums_no_rows_give_are_refused_in_one_line():
    n, total, sumsq = feature_sums(ROWS["d0"])
    assert sums_refusal(n, total, sumsq, width=5) is None
    assert "the task's model takes 7" in sums_refusal(n, total, sumsq, width=7)
    assert "n = 4611686018427387904 rows" in sums_refusal(2**62, total, sumsq)
    huge = np.full(5, 1.7e308)
    assert "overflow" in sums_refusal(10, huge, huge)
    assert "negative variance" in sums_refusal(10, np.full(5, 100.0), np.full(5, 1.0))
    constant = feature_sums(np.full((12, 5), 0.1))  # rounding leaves Σx²/n − mean² a hair below 0
    assert sums_refusal(*constant) is None


def _liar(n: int, mean: float, std: float) -> tuple[int, np.ndarray, np.ndarray]:
    return n, np.full(5, n * mean), np.full(5, n * (std**2 + mean**2))


def test_one_liar_moves_the_pooled_transform_a_bounded_amount():
    honest = {d: feature_sums(x) for d, x in ROWS.items() if d != "d3"}
    alone = pool_feature_sums(honest, 3)
    liar = (10, np.zeros(5), np.full(5, 1e30))  # issue 32: std 1.1e14 on every feature before
    pooled = pool_feature_sums(honest | {"d3": liar}, 3)
    assert np.all(pooled.std <= CLIP_RATIO * 1.5 * alone.std) and np.all(pooled.std >= alone.std / 2)
    assert np.all(np.abs(pooled.mean - alone.mean) <= CLIP_RATIO * alone.std)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 10**6),
    mean=st.floats(-1e100, 1e100),
    std=st.floats(0.0, 1e100),
)
def test_whatever_one_liar_sends_the_pool_stays_near_the_honest_devices(n, mean, std):
    honest = {d: feature_sums(x) for d, x in ROWS.items() if d != "d3"}
    sums = _liar(n, mean, std)
    if sums_refusal(*sums) is not None:
        return
    pooled = pool_feature_sums(honest | {"d3": sums}, 3)
    means = np.array([s[1] / s[0] for s in honest.values()])
    stds = np.array([Standardizer.from_sums([s]).std for s in honest.values()])
    # Each device is clipped within CLIP_RATIO of the median device, whose moments lie between the
    # honest ones; the means' reach is CLIP_RATIO × √(s² + d²), d (1.4826 MAD) at most 1.4826 × the
    # honest means' range: the pooled mean within that reach of theirs, its deviation within
    # [min / 3, √(9 max² + reach²)] (Σ w s² ≤ 9 max², Σ w (m − μ)² ≤ (2 reach)² / 4).
    hi = stds.max(axis=0)
    spread = 1.4826 * (means.max(axis=0) - means.min(axis=0))
    reach = CLIP_RATIO * np.hypot(hi, spread) * (1 + 1e-9)
    assert np.all(pooled.std >= stds.min(axis=0) / CLIP_RATIO * (1 - 1e-9))
    assert np.all(pooled.std <= np.hypot(CLIP_RATIO * hi, reach))
    assert np.all(pooled.mean >= means.min(axis=0) - reach)
    assert np.all(pooled.mean <= means.max(axis=0) + reach)


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
    # ... and malformed statistics are still named for what they are, not merely "frozen".
    pool.handle("tool", "d3", _stats("d3", ROWS["d3"][:, :4]))
    assert "4 features per row; the task's model takes 5" in pool.refused["tool"]["d3"]
    pool.republish()
    assert sent[1] == sent[0]


def test_the_simulator_trains_every_client_through_the_pooled_transform():
    clients = {d: ClientData(Dataset(x, np.zeros((len(x), 3))), None) for d, x in ROWS.items()}
    fleet = SimulatedFleet(_spec(), clients)
    pooled = pool_feature_sums({d: feature_sums(x) for d, x in ROWS.items()}, 3)
    for d, x in ROWS.items():
        np.testing.assert_array_equal(fleet.clients[d].train.x, pooled.transform(x, np.float64))


def test_the_model_not_the_first_device_fixes_the_width_and_refusals_are_rate_limited(caplog):
    sent: list[tuple[str, bytes]] = []
    rows = {"d0": 12, "d1": 13, "d2": 5}
    pool = ScalingPool("f", lambda t, p: sent.append((t, p)), lambda task, d: None, rows.get)
    pool.task(_spec())
    seven = FeatureStats("tool", "liar", *feature_sums(RNG.normal(size=(20, 7)))).encode()
    with caplog.at_level(logging.WARNING, logger="cloud_aggregator.serve.fleet_scaling"):
        for _ in range(1000):  # first, and in a loop: fixes nothing, and says so once
            pool.handle("tool", "liar", seven)
        huge = FeatureStats("tool", "big", 2**62, *feature_sums(ROWS["d3"])[1:]).encode()
        pool.handle("tool", "big", huge)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "7 features per row; the task's model takes 5" in lines[0]
    assert "n = 4611686018427387904 rows" in lines[1]
    for d in ("d0", "d1", "d2"):  # d2 claims more rows than its status reports: it weighs 5
        pool.handle("tool", d, _stats(d, ROWS[d]))
    assert len(sent) == 1 and set(pool.refused["tool"]) == {"liar", "big"}
    published = FleetScaling.decode(sent[0][1])
    assert published.devices == ("d0", "d1", "d2") and published.rows == 12 + 13 + 5

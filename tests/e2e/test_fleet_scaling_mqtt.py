"""``scaling = "fleet"`` on real processes and a real mosquitto: three recorded welders send their
feature sums once, ``cloud-aggregator serve`` pools them and publishes one transform (retained),
and every device trains and serves through exactly that transform."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cloud_aggregator.local.fleet import FLEET, Sniffer, aggregator_toml
from edge.segments import DatasetReader
from edge.serving.offers import model_path
from ioft_protocol import topics
from ioft_protocol.feature_stats import FeatureStats, FleetScaling
from ioft_protocol.state import load_arrays
from sensors.features.scaling import feature_sums, pool_feature_sums
from tests.e2e.test_serving import WELD_TASK, record

DEVICES = ("w1", "w2", "w3")
TASK = WELD_TASK | {"hparams": WELD_TASK["hparams"] | {"scaling": "fleet"}}


@pytest.mark.broker
def test_devices_pool_their_feature_sums_and_all_apply_one_transform(fleet_procs):
    work = fleet_procs.work
    for dev in DEVICES:
        record(work, dev, "welder", "--welds", "30", "--weld-s", "0.02")
        fleet_procs.start_device(dev, "--log-level", "INFO", simulate=None)
    sniffer = Sniffer(fleet_procs.broker_url)
    try:
        toml = aggregator_toml(
            fleet_procs.broker_url,
            work / "aggregator",
            [TASK],
            expected=list(DEVICES),
            startup_wait_s=30,
            deadline_s=60,  # closes once all three answered; a loaded machine must not abandon round 1
        )
        fleet_procs.start_aggregator(toml)
        assert fleet_procs.wait_aggregator(180) == 0, fleet_procs.log("aggregator")[-3000:]
        for dev in DEVICES:
            fleet_procs.wait_for(
                lambda d=dev: "serves its model of round" in fleet_procs.log(d), 60, f"{dev} serving a model"
            )
    finally:
        sniffer.stop()
    assert [r.status for r in fleet_procs.rounds("tool")] == ["completed"] * 2

    # Each device sent its sums (once per round announced before the transform came: on a loaded
    # machine that may be more than once), over its own training rows, and no row.
    stats = [
        FeatureStats.decode(p)
        for t, p in sniffer.messages
        if t.startswith(f"ioft/v1/{FLEET}/task/tool/stats/")
    ]
    assert sorted({s.device for s in stats}) == sorted(DEVICES)
    train = {d: DatasetReader(work / d) for d in DEVICES}
    for r in train.values():
        r.refresh()
    for s in stats:
        n, total, sumsq = feature_sums(train[s.device].train.x)
        assert s.n == n and np.array_equal(s.sum, total) and np.array_equal(s.sumsq, sumsq)

    # One transform, published once, pooled from all three: the same bits as pooling in process.
    published = [p for t, p in sniffer.messages if t == topics.topic_scaling(FLEET, "tool")]
    assert len(set(published)) == 1
    pooled = FleetScaling.decode(published[0])
    want = pool_feature_sums({d: feature_sums(r.train.x) for d, r in train.items()}, 3)
    assert (
        pooled.devices == DEVICES
        and np.array_equal(pooled.mean, want.mean)
        and np.array_equal(pooled.std, want.std)
    )
    assert "fleet scaling published, pooled from 3 devices" in fleet_procs.log("aggregator")

    # Every device applied it, and its serving model answers through the same transform.
    for dev in DEVICES:
        assert "fleet scaling pooled from 3 devices" in fleet_procs.log(dev)
        arrays, _ = load_arrays(model_path(work / dev, "tool"))
        assert np.array_equal(arrays["scale.mean"], pooled.mean) and np.array_equal(
            arrays["scale.std"], pooled.std
        )


@pytest.mark.broker
def test_a_lying_device_neither_fixes_the_width_nor_poisons_the_transform_nor_stops_the_task(fleet_procs):
    # issue 32 §1.  A raw client with two devices' identities (a plaintext test broker): "w5" sends
    # 7 features, "w4" n = 10, Σx = 0, Σx² = 1e30 on all 624, both in a loop from the start.  Before,
    # the first stats fixed the width, w4's made the pooled std 1.1e14, and 27,000 lines were logged.
    work = fleet_procs.work
    for dev in DEVICES:
        record(work, dev, "welder", "--welds", "30", "--weld-s", "0.02")
        fleet_procs.start_device(dev, "--log-level", "INFO", simulate=None)
    liar_task = TASK | {"hparams": TASK["hparams"] | {"scaling_min_devices": 4}}
    sniffer = Sniffer(fleet_procs.broker_url)
    narrow = FeatureStats("tool", "w5", 20, np.ones(7), np.ones(7) * 3).encode()
    poison = FeatureStats("tool", "w4", 10, np.zeros(624), np.full(624, 1e30)).encode()
    stop = threading.Event()

    def lie() -> None:
        # w4 first: the pool needs w4 (scaling_min_devices = 4), so the w4 message it takes came after the
        # announcement, and w5's, sent after it on the same connection, reaches the aggregator before
        # the task can end (a round or two can take 50 ms: a fixed period alone left it to chance).
        while not stop.wait(0.2):
            sniffer.client.publish(topics.topic_stats(FLEET, "tool", "w4"), poison, qos=1)
            sniffer.client.publish(topics.topic_stats(FLEET, "tool", "w5"), narrow, qos=1)

    liar = threading.Thread(target=lie, daemon=True)
    liar.start()
    try:
        toml = aggregator_toml(
            fleet_procs.broker_url,
            work / "aggregator",
            [liar_task],
            expected=list(DEVICES),
            startup_wait_s=30,
            deadline_s=60,
        )
        fleet_procs.start_aggregator(toml)
        assert fleet_procs.wait_aggregator(180) == 0, fleet_procs.log("aggregator")[-3000:]
    finally:
        stop.set()
        liar.join()
        sniffer.stop()
    # The task ran: no round abandoned for the width w5 tried to fix.
    assert [r.status for r in fleet_procs.rounds("tool")] == ["completed"] * 2
    published = [p for t, p in sniffer.messages if t == topics.topic_scaling(FLEET, "tool")]
    assert len(set(published)) == 1
    pooled = FleetScaling.decode(published[0])
    assert pooled.devices == ("w1", "w2", "w3", "w4")
    # w4 is pooled, clipped toward the median device: the transform stays within a few of the
    # honest fleet's deviations of it, where before its std was 1e14 on every feature.
    train = {d: DatasetReader(work / d) for d in DEVICES}
    for r in train.values():
        r.refresh()
    # Each device is clipped toward the median device, whose moments lie among the honest
    # devices': the bounds of tests/cloud_aggregator/test_fleet_scaling.py's property test.
    stds = np.array([r.train.x.std(axis=0) for r in train.values()])
    means = np.array([r.train.x.mean(axis=0) for r in train.values()])
    hi = stds.max(axis=0)
    reach = 3 * np.hypot(hi, 1.4826 * (means.max(axis=0) - means.min(axis=0))) * (1 + 1e-9)
    assert np.all(pooled.std <= np.hypot(3 * hi, reach)) and np.all(pooled.std >= stds.min(axis=0) / 3.01)
    assert np.all(pooled.mean >= means.min(axis=0) - reach) and np.all(
        pooled.mean <= means.max(axis=0) + reach
    )
    # w5's stats are refused in one line per minute, not one per message.
    log = fleet_procs.log("aggregator")
    assert 1 <= log.count("refused feature statistics from w5") <= 4  # a reason a minute
    assert "features per row; the task's model takes 624" in log

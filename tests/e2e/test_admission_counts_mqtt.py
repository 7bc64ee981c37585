"""Forged sample counts and metrics on a real mosquitto, against ``serve`` and three ``edge-trainer``s.

An adversary with the broker's credentials answers each round before the devices do: as printer1
with ``n_samples = 2^62`` (under the ``samples`` weighting, the round's mean would be its upload),
as printer2 with one more sample than the training rows printer2's own retained status reports,
and as printer3 with a NaN metric and with 20,000 metrics.  Every one is refused with its reason
code, the devices' honest answers count, and no round record holds a forged count or metric.
"""

from __future__ import annotations

import json
import math

import numpy as np
import paho.mqtt.client as paho
import pytest

from cloud_aggregator.local_fleet import FLEET, aggregator_toml, pflda_task
from ioft_protocol import round_messages, topics

DEVICES = ["printer1", "printer2", "printer3"]
ROUNDS = 3


class Forger:
    """Publishes forged answers for each running round it sees announced."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.rounds: list[int] = []
        self.rows: dict[str, int] = {}
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311
        )
        self.client.on_connect = lambda c, *a: c.subscribe(
            [(topics.topic_down(FLEET, "speed"), 1), (topics.topic_status_all(FLEET), 1)]
        )
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        if msg.topic != topics.topic_down(FLEET, "speed"):
            status = json.loads(msg.payload or b"{}")
            train = status.get("data", {}).get("train")
            if isinstance(train, int):
                self.rows[status["device"]] = train
            return
        ann = round_messages.Announcement.decode(bytes(msg.payload))
        if ann.state != "running" or ann.round in self.rounds or "printer2" not in self.rows:
            return

        def forged(device: str, n: int, metrics: dict[str, float]) -> bytes:
            return round_messages.UpdateMessage(
                FLEET, "speed", device, ann.round, ann.phase, n, ann.global_hash, metrics, ann.params
            ).encode()

        up = lambda dev: topics.topic_up(FLEET, "speed", dev)  # noqa: E731
        client.publish(up("printer1"), forged("printer1", 2**62, {}), qos=1)
        client.publish(up("printer2"), forged("printer2", self.rows["printer2"] + 1, {}), qos=1)
        client.publish(up("printer3"), forged("printer3", 1, {"train_loss": math.nan}), qos=1)
        many = {f"m{i:05d}": 1.0 for i in range(20_000)}
        client.publish(up("printer3"), forged("printer3", 1, many), qos=1)
        self.rounds.append(ann.round)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.broker
def test_forged_sample_counts_and_metrics_are_refused_over_mqtt(fleet_procs):
    from cloud_aggregator.store import SqliteStore

    task = {**pflda_task(rounds=ROUNDS), "server": {"weighting": "samples"}}
    forger = Forger(fleet_procs.broker_url)
    try:
        for d in DEVICES:
            fleet_procs.start_device(d)
        toml = aggregator_toml(
            fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES, deadline_s=30
        )
        fleet_procs.start_aggregator(toml)
        assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
    finally:
        forger.stop()
    records = fleet_procs.rounds()
    assert [r.status for r in records] == ["completed"] * ROUNDS
    assert all(sorted(r.participants) == DEVICES for r in records)  # the honest answers count
    for r in records:
        assert all(r.n_samples[d] <= forger.rows[d] for d in DEVICES), r.n_samples
        assert all(len(m) < 64 and all(math.isfinite(v) for v in m.values()) for m in r.metrics.values())
    store = SqliteStore(fleet_procs.db)
    by_reason = store.rejection_counts_by_reason("speed")
    final = store.get_params(records[-1].global_hash)
    store.close()
    assert all(np.isfinite(v).all() for v in final.values())
    assert forger.rounds
    # A forged answer that lands after its round closed is a stale one: counted, not judged.
    assert by_reason["printer1"].get("n_samples", 0) >= 1, by_reason
    assert by_reason["printer2"].get("n_samples", 0) >= 1, by_reason
    assert by_reason["printer3"].get("non_finite", 0) >= 1, by_reason
    assert by_reason["printer3"].get("metrics", 0) >= 1, by_reason
    log = fleet_procs.log("aggregator")
    assert "exceeds the task's max_samples" in log
    assert "training rows its status reports" in log

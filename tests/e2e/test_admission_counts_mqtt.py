"""Forged sample counts and metrics on a real mosquitto, against ``serve`` and three ``edge-trainer``s.

An adversary with the broker's credentials runs a fourth device, printer4: it publishes a
retained status reporting 50 training rows, and answers each round first with
``n_samples = 2^62`` (under the ``samples`` weighting, the round's mean would be its upload),
then with 51 samples (one more than its status reports), a NaN metric, 20,000 metrics, and
last an honest-looking answer.  The round waits for printer4, so every forged answer is judged
in its round: each is refused with its reason code, the last one counts, and no round record
holds a forged count or metric.
"""

from __future__ import annotations

import json
import math

import numpy as np
import paho.mqtt.client as paho
import pytest

from cloud_aggregator.local.fleet import FLEET, aggregator_toml, pflda_task
from ioft_protocol import round_messages, topics

DEVICES = ["printer1", "printer2", "printer3"]
FORGED = "printer4"
ROWS = 50
ROUNDS = 3


class Forger:
    """printer4, forged: a status with ``ROWS`` rows, then forged answers to each running round."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.rounds: list[int] = []
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311
        )
        self.client.on_connect = lambda c, *a: c.subscribe(topics.topic_down(FLEET, "speed"), qos=1)
        self.client.on_message = self._on_announcement
        self.client.connect(host, int(port))
        status = {"device": FORGED, "state": "online", "data": {"train": ROWS, "test": 10}}
        self.client.publish(topics.topic_status(FLEET, FORGED), json.dumps(status), qos=1, retain=True)
        self.client.loop_start()

    def _on_announcement(self, client, userdata, msg) -> None:
        ann = round_messages.Announcement.decode(bytes(msg.payload))
        if ann.state != "running" or ann.round in self.rounds:
            return

        def answer(n: int, metrics: dict[str, float]) -> bytes:
            return round_messages.UpdateMessage(
                FLEET, "speed", FORGED, ann.round, ann.phase, n, ann.global_hash, metrics, ann.params
            ).encode()

        up = topics.topic_up(FLEET, "speed", FORGED)
        client.publish(up, answer(2**62, {}), qos=1)
        client.publish(up, answer(ROWS + 1, {}), qos=1)
        client.publish(up, answer(ROWS, {"train_loss": math.nan}), qos=1)
        client.publish(up, answer(ROWS, {f"m{i:05d}": 1.0 for i in range(20_000)}), qos=1)
        client.publish(up, answer(ROWS, {"train_loss": 0.5}), qos=1)  # the one that counts
        self.rounds.append(ann.round)

    def stop(self) -> None:
        self.client.publish(topics.topic_status(FLEET, FORGED), b"", qos=1, retain=True).wait_for_publish(5)
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.broker
def test_forged_sample_counts_and_metrics_are_refused_over_mqtt(fleet_procs):
    from cloud_aggregator.store.sqlite import SqliteStore

    task = {**pflda_task(rounds=ROUNDS), "server": {"weighting": "samples"}}
    forger = Forger(fleet_procs.broker_url)
    try:
        for d in DEVICES:
            fleet_procs.start_device(d)
        toml = aggregator_toml(
            fleet_procs.broker_url,
            fleet_procs.work / "aggregator",
            [task],
            expected=[*DEVICES, FORGED],
            deadline_s=60,
        )
        fleet_procs.start_aggregator(toml)
        assert fleet_procs.wait_aggregator(180) == 0, fleet_procs.log("aggregator")
    finally:
        forger.stop()
    records = fleet_procs.rounds()
    assert [r.status for r in records] == ["completed"] * ROUNDS
    assert all(sorted(r.participants) == [*DEVICES, FORGED] for r in records)
    for r in records:
        assert r.n_samples[FORGED] == ROWS, r.n_samples
        assert r.metrics[FORGED] == {"train_loss": 0.5}
        assert all(math.isfinite(v) for m in r.metrics.values() for v in m.values())
    store = SqliteStore(fleet_procs.db)
    by_reason = store.rejection_counts_by_reason("speed")
    final = store.get_params(records[-1].global_hash)
    store.close()
    assert all(np.isfinite(v).all() for v in final.values())
    assert by_reason == {FORGED: {"n_samples": 2 * ROUNDS, "non_finite": ROUNDS, "metrics": ROUNDS}}
    log = fleet_procs.log("aggregator")
    assert "exceeds the task's max_samples" in log
    assert "training rows its status reports" in log

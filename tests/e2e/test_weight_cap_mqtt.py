"""Issue 32 §2 on a real mosquitto, against ``serve`` and three ``edge-trainer``s: printer4, a raw
client with a device's identity, reports a million training rows in its status and answers each
round with ``n_samples = 1,000,000`` and the global moved by +10 on every parameter.  Under the
``samples`` weighting that took 99.99 % of the mean; now it counts ``max_weight_ratio`` (3) ×
the round's median, every round records the cut, and the aggregator says so once per round."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import pytest

from cloud_aggregator.local.fleet import FLEET, aggregator_toml, pflda_task
from ioft_protocol import round_messages, topics

DEVICES = ["printer1", "printer2", "printer3"]
LIAR = "printer4"
CLAIM = 1_000_000
ROUNDS = 3


class Claimer:
    """printer4: a status with a million rows, and an answer claiming them to each running round."""

    def __init__(self, url: str, task: str = "speed", tls: tuple[Path, Path, Path] | None = None) -> None:
        """``tls``: the CA, certificate and key of printer4 on a ``fleet init`` fleet (``mqtts://``)."""
        host, port = url.split("://")[1].split(":")
        self.task = task
        self.rounds: list[int] = []
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, client_id=LIAR, protocol=paho.MQTTv311
        )
        if tls is not None:
            self.client.tls_set(ca_certs=str(tls[0]), certfile=str(tls[1]), keyfile=str(tls[2]))
        self.client.on_connect = lambda c, *a: c.subscribe(topics.topic_down(FLEET, task), qos=1)
        self.client.on_message = self._on_announcement
        self.client.connect(host, int(port))
        status = {"device": LIAR, "state": "online", "data": {"train": CLAIM, "test": 10}}
        self.client.publish(topics.topic_status(FLEET, LIAR), json.dumps(status), qos=1, retain=True)
        self.client.loop_start()

    def _on_announcement(self, client, userdata, msg) -> None:
        ann = round_messages.Announcement.decode(bytes(msg.payload))
        if ann.state != "running" or ann.round in self.rounds:
            return
        moved = {k: (v + 10).astype(v.dtype) for k, v in ann.params.items()}
        up = round_messages.UpdateMessage(
            FLEET, self.task, LIAR, ann.round, ann.phase, CLAIM, ann.global_hash, {}, moved
        )
        client.publish(topics.topic_up(FLEET, self.task, LIAR), up.encode(), qos=1)
        self.rounds.append(ann.round)

    def stop(self) -> None:
        self.client.publish(topics.topic_status(FLEET, LIAR), b"", qos=1, retain=True).wait_for_publish(5)
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.broker
def test_a_device_claiming_a_million_rows_counts_a_few_times_the_median_over_mqtt(fleet_procs):
    task = {**pflda_task(rounds=ROUNDS), "server": {"weighting": "samples"}}
    claimer = Claimer(fleet_procs.broker_url)
    try:
        for d in DEVICES:
            fleet_procs.start_device(d)
        toml = aggregator_toml(
            fleet_procs.broker_url,
            fleet_procs.work / "aggregator",
            [task],
            expected=[*DEVICES, LIAR],
            deadline_s=60,
        )
        fleet_procs.start_aggregator(toml)
        assert fleet_procs.wait_aggregator(180) == 0, fleet_procs.log("aggregator")
    finally:
        claimer.stop()
    records = fleet_procs.rounds()
    assert [r.status for r in records] == ["completed"] * ROUNDS
    for r in records:
        assert sorted(r.participants) == [*DEVICES, LIAR] and r.n_samples[LIAR] == CLAIM
        honest = sorted(r.n_samples[d] for d in DEVICES)
        # Round 1 cuts at its own median; rounds 2-3 fold, cut at round 1's (the claims'; the liar's among them).
        cap = int(3 * np.median(list(records[0].n_samples.values())))
        assert r.extra["weight_cut"] == {LIAR: [CLAIM, cap]}, r.extra
        assert cap / (cap + sum(honest)) <= 0.5  # its share of the mean; 99.99 % before
    log = fleet_procs.log("aggregator")
    assert log.count("count fewer samples than they claim") == ROUNDS
    assert f"{LIAR} {CLAIM} → " in log

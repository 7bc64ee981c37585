"""Admission is the same code in simulation and over MQTT: the same bad uploads, the same reasons.

Each round the in-process simulator's printers train, and a scripted adversary turns their
uploads into a sequence of hostile ones followed by the honest ones (and a replay).  The
simulator hands that sequence to its admission pipeline directly; over MQTT the same
sequence is encoded and published on a real mosquitto, to an ``MqttFleet`` driven by the
same round engine.  Both must refuse the same uploads for the same reasons, per device,
store the same counts, and end with bit-identical global parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.simulation import SimulatedFleet, Uplink
from cloud_aggregator.rounds.types import CollectRequest, LateUpdate, Rejection
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions
from tests.e2e.test_converged_fleet import printer_clients
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

FLEET = "plant"
PRINTERS = ("printer1", "printer2", "printer3")
SPEC = TaskSpec(
    "speed",
    "pflda",
    "sigmoid_glm",
    hparams={"lr": 0.05, "local_steps": 5, "lam": 0.9},
    server={"weighting": "uniform"},
    rounds=4,
    seed=3,
)
#: Per device, what the adversary's uploads must be refused as over the 4 rounds.
EXPECTED_REFUSALS = {
    "printer1": {"malformed": 4, "stale_round": 4, "wrong_task": 4, "replay": 4, "resent": 4},
    "printer2": {"impersonation": 4, "future_round": 4, "shape_dtype": 4},
    "printer3": {"non_finite": 4, "wrong_global": 4, "norm": 1},
}


def hostile(request: CollectRequest, sent: list[Uplink]) -> list[Uplink]:
    """The honest uploads, preceded by one bad upload per reason, and printer1's sent twice (a
    copy: resent) and followed by another answer of its own (a replay)."""
    honest = dict(sent)
    p1, p2, p3 = (honest[d] for d in PRINTERS)
    bad: list[Uplink] = [
        ("printer1", b"\x00not an update" * 4),
        ("printer2", p1.encode()),  # printer1's upload on printer2's topic
        (
            "printer3",
            dataclasses.replace(p3, params={n: np.full_like(v, np.nan) for n, v in p3.params.items()}),
        ),
        ("printer1", dataclasses.replace(p1, round=request.round - 1)),
        ("printer2", dataclasses.replace(p2, round=request.round + 1)),
        ("printer3", dataclasses.replace(p3, global_hash="0" * 64)),
        ("printer1", dataclasses.replace(p1, task="other-task")),
        ("printer2", dataclasses.replace(p2, params={n: v[..., :0] for n, v in p2.params.items()})),
    ]
    if request.round == SPEC.rounds:  # 9 changes known by now: the running median judges
        huge = {n: (v + 1e6).astype(v.dtype) for n, v in p3.params.items()}
        bad.append(("printer3", dataclasses.replace(p3, params=huge)))
    # The round closes once all three answered: the copy and the replay come before the last honest upload.
    # Another answer (one sample fewer: more than the device's reported rows is its own refusal).
    replay = dataclasses.replace(p1, n_samples=p1.n_samples - 1)
    return [
        *bad,
        ("printer1", p1),
        ("printer1", p1),
        ("printer1", replay),
        ("printer2", p2),
        ("printer3", p3),
    ]


class RelayFleet:
    """Trains in process, publishes the adversary's sequence on the broker, collects over MQTT."""

    def __init__(self, trainer: SimulatedFleet, publisher: MqttSession, fleet: MqttFleet) -> None:
        self.trainer, self.publisher, self.fleet = trainer, publisher, fleet
        self._sent: list[Uplink] = []
        trainer.uplinks = self._capture

    def _capture(self, request: CollectRequest, sent: list[Uplink]) -> Sequence[Uplink]:
        self._sent = sent
        return []  # nothing reaches the trainer's own admission: the broker carries it

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection | LateUpdate]:
        self.trainer.collect(request)
        for device, upload in hostile(request, self._sent):
            payload = upload if isinstance(upload, bytes) else upload.encode()
            self.publisher.publish(topics.topic_up(FLEET, SPEC.name, device), payload, timeout=10)
        return self.fleet.collect(request)


def _session(url: str, client_id: str) -> MqttSession:
    session = MqttSession(SessionOptions(BrokerAddress.parse(url), client_id))
    session.start(timeout=10)
    return session


@pytest.mark.broker
def test_simulator_and_mqtt_fleet_refuse_the_same_uploads_for_the_same_reasons(mosquitto, tmp_path):
    sim = SimulatedFleet(SPEC, printer_clients(PRINTERS), uplinks=hostile, fleet=FLEET)
    sim_records = []
    sim_final = RoundEngine(SPEC, sim, on_record=sim_records.append).run()

    store = SqliteStore(tmp_path / "aggregator.sqlite")
    aggregator = _session(mosquitto.url, "aggregator")
    publisher = _session(mosquitto.url, "adversary")
    try:
        policy = CollectPolicy(deadline_s=30, expected=PRINTERS, max_extensions=0)
        mqtt = MqttFleet(aggregator, FLEET, policy, store)
        # The broker takes subscriptions in order: once this one delivers its retained message,
        # the fleet's (sent before it) are active, and nothing published from now on is lost.
        publisher.publish("probe/ready", b"1", retain=True, timeout=10)
        aggregator.subscribe("probe/ready")
        while (msg := aggregator.get(10)) is None or msg.topic != "probe/ready":
            assert msg is not None, "the broker never delivered the probe"
        mqtt_records = []
        relay = RelayFleet(SimulatedFleet(SPEC, printer_clients(PRINTERS), fleet=FLEET), publisher, mqtt)
        mqtt_final = RoundEngine(SPEC, relay, store=store, on_record=mqtt_records.append).run()
        stored = store.rejection_counts_by_reason(SPEC.name)
    finally:
        publisher.stop()
        aggregator.stop()
        store.close()

    assert {d: dict(per) for d, per in sim.admission.refused.items()} == EXPECTED_REFUSALS
    assert mqtt.admission.refused == sim.admission.refused
    assert stored == EXPECTED_REFUSALS
    assert [r.rejected for r in mqtt_records] == [r.rejected for r in sim_records]
    assert all(sorted(r.participants) == list(PRINTERS) for r in sim_records + mqtt_records)
    assert [r.global_hash for r in mqtt_records] == [r.global_hash for r in sim_records]
    assert param_hash(mqtt_final) == param_hash(sim_final)

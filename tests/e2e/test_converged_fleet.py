"""A converged fleet does not stall: honest devices that upload bit-identical tensors are admitted.

With its learning rate decayed to ~0, PFL-DA's Adam steps round to the same float32 values
on every printer: devices upload equal shared tensors, and a device repeats its own upload
from round to round.  The old tensor-fingerprint "replay" check refused them, and every
round waited out its deadline.  Replay is now a second answer to a (device, task, round,
phase), or an upload whose round fields do not name the open round.

The demo's fleet (four simulated printers, the demo's hyperparameters: the learning rate
decays 5 % every 5 rounds, so equal uploads begin near round 1,100) runs 2,000 rounds, in
process through the admission pipeline and over MQTT between real mosquitto, aggregator and
``edge-trainer`` processes.  Both assert on logical properties only: every round closed with
every printer's upload (a round closes early only then), nothing refused.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from cloud_aggregator.local.demo import HPARAMS
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet
from cloud_aggregator.store.sqlite import SqliteStore
from edge.config import DataConfig
from edge.simulated import simulated_printer_dataset
from trainer_lite.task import TaskSpec

PRINTERS = [f"printer{i}" for i in range(1, 5)]


def _tensor_digest(params: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode() + np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()


def printer_clients(names: Sequence[str] = PRINTERS) -> dict[str, ClientData]:
    """The demo's simulated printers (what ``edge-trainer --simulate printer`` trains on)."""
    out = {}
    for name in names:
        train, test, _ = simulated_printer_dataset(name, DataConfig(source="simulate-printer"))
        out[name] = ClientData(train, test)
    return out


@pytest.mark.slow
def test_2000_rounds_of_a_converged_fleet_in_process_refuse_nothing():
    spec = TaskSpec(
        "speed-pflda",
        "pflda",
        "sigmoid_glm",
        hparams={**HPARAMS, "lam": 0.9},
        server={"weighting": "uniform"},
        rounds=2000,
        seed=0,
    )
    collisions: Counter[str] = Counter()
    previous: dict[str, str] = {}

    def watch(request, sent):
        """Count the rounds where two printers, or one printer and its last round, upload the same."""
        digests = {device: _tensor_digest(msg.params) for device, msg in sent}
        if len(set(digests.values())) < len(digests):
            collisions["across devices"] += 1
        if any(previous.get(d) == h for d, h in digests.items()):
            collisions["across rounds"] += 1
        previous.update(digests)
        return sent

    fleet = SimulatedFleet(spec, printer_clients(), uplinks=watch)
    records = []
    RoundEngine(spec, fleet, min_participants=2, on_record=records.append).run()

    # The condition the old check tripped on did arise, many times (from round ~1,100).
    assert collisions["across devices"] > 100 and collisions["across rounds"] > 100, collisions
    assert len(records) == 2000
    assert all(r.status == "completed" and sorted(r.participants) == PRINTERS for r in records)
    assert not any(r.rejected for r in records)
    assert fleet.admission.refused == {}


def _aggregator_toml(broker: str, state_dir, rounds: int, deadline_s: float, **hparams: float) -> str:
    hp = ", ".join(f"{k} = {v}" for k, v in {**HPARAMS, "lam": 0.9, **hparams}.items())
    expected = ", ".join(f'"{d}"' for d in PRINTERS)
    return f"""fleet = "test"
broker = "{broker}"
state_dir = "{state_dir}"
allow_plaintext = true

[collect]
deadline_s = {deadline_s}
min_participants = 2
max_extensions = 0
startup_wait_s = 60
expected = [{expected}]

[[task]]
name = "speed"
algorithm = "pflda"
model = "sigmoid_glm"
rounds = {rounds}
seed = 0
hparams = {{ {hp} }}
server = {{ weighting = "uniform" }}
"""


@pytest.mark.broker
@pytest.mark.slow
def test_2000_rounds_of_a_converged_fleet_over_mqtt_never_wait_for_a_deadline(fleet_procs):
    """The issue's run: the old code refused a printer as a "replay" from round ~1,100 on."""
    rounds = 2000
    for name in PRINTERS:
        fleet_procs.start_device(name, "--log-level", "WARNING")
    fleet_procs.start_aggregator(
        _aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", rounds, deadline_s=10)
    )
    assert fleet_procs.wait_aggregator(900) == 0, fleet_procs.log("aggregator")[-3000:]

    records = fleet_procs.rounds("speed")
    assert [r.round for r in records] == list(range(1, rounds + 1))
    # A round closes before its deadline only once every expected printer's upload is admitted.
    short = [r.round for r in records if sorted(r.participants) != PRINTERS]
    assert short == [], f"rounds that waited out their deadline: {short[:20]}"
    assert not any(r.rejected for r in records)
    store = SqliteStore(fleet_procs.db, readonly=True)
    try:
        assert store.rejection_counts_by_reason() == {}
    finally:
        store.close()
    log = fleet_procs.log("aggregator")
    assert "dropped update" not in log and "extending the deadline" not in log, log[-3000:]

"""The same algorithm code over MQTT between processes and in one process: same result.

FedDAR-SA (two phases per round: domain heads with their Hessians, then the shared
encoder) and PFL-DA (personal encoder, shared decoder, pull) run on three `edge-trainer` processes whose local datasets were written
into their state directories, and in the in-process simulator on the same data.
Seeds derive from (task seed, device, round, phase) and the aggregator sums in
device order, so the final global parameters must agree bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cloud_aggregator.local.fleet import aggregator_toml
from cloud_aggregator.rounds.simulation import ClientData, simulate
from cloud_aggregator.store.sqlite import SqliteStore
from edge.dataset import save_dataset
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

D, K, M = 6, 2, 3
DEVICES = ["cell1", "cell2", "cell3"]
FEDDAR = {
    "name": "feddar",
    "algorithm": "feddar",
    "model": "linear_rep",
    "model_args": {"d_in": D, "k": K},
    "hparams": {"n_domains": M, "optimizer": "sgd", "lr": 0.05, "aggregation": "sa", "head_steps": 5},
    "dtype": "float64",
    "rounds": 3,
    "seed": 7,
}
PFLDA = {
    "name": "pflda",
    "algorithm": "pflda",
    "model": "sigmoid_glm",
    "hparams": {"lr": 0.05, "local_steps": 5, "lam": 0.9},
    "server": {"weighting": "uniform"},
    "rounds": 4,
    "seed": 3,
}


def _client_data(rng: np.random.Generator, d_in: int) -> dict[str, ClientData]:
    """FedDAR's linear model y = xᵀBw_m (§5.1), each client with its own mix of domains."""
    b = np.linalg.qr(rng.standard_normal((d_in, K)))[0]
    w = rng.standard_normal((M, K))
    out = {}
    for device in DEVICES:
        mix = rng.dirichlet(np.full(M, 0.5))

        def split(n: int, mix=mix) -> Dataset:
            dom = rng.choice(M, size=n, p=mix)
            x = rng.standard_normal((n, d_in))
            y = np.einsum("nd,dk,nk->n", x, b, w[dom])[:, None]
            return Dataset(x, y, dom)

        out[device] = ClientData(split(30), split(10))
    return out


@pytest.mark.broker
@pytest.mark.any_broker
@pytest.mark.parametrize("task", [FEDDAR, PFLDA], ids=lambda t: t["name"])
def test_over_mqtt_matches_the_in_process_simulation(fleet_procs, task):
    clients = _client_data(np.random.default_rng(0), d_in=task.get("model_args", {}).get("d_in", 1))
    for device, data in clients.items():
        save_dataset(fleet_procs.work / device, data.train, data.test, {"source": "test"})
        fleet_procs.start_device(device, simulate=None)  # trains on the dataset written above
    fleet_procs.start_aggregator(
        aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES)
    )
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")[-3000:]

    spec = TaskSpec.from_json(json.dumps(task))
    phases = make_client(spec).phases()
    records = fleet_procs.rounds(spec.name)
    assert [(r.round, r.phase, r.status) for r in records] == [
        (r, p, "completed") for r in range(1, spec.rounds + 1) for p in phases
    ]
    assert all(sorted(r.participants) == DEVICES for r in records)
    store = SqliteStore(fleet_procs.db, readonly=True)
    try:
        over_mqtt = store.resume_point(spec.name)[2]
    finally:
        store.close()

    in_process, _, sim_records = simulate(spec, clients)
    assert sorted(over_mqtt) == sorted(in_process)
    assert param_hash(over_mqtt) == param_hash(in_process)
    assert [r.global_hash for r in records] == [r.global_hash for r in sim_records]

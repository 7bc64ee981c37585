"""A task with ``[task.compress] bits = 1`` over a real mosquitto: three `edge-trainer` processes
upload 1-bit codes of their change, the aggregator decodes them into its streaming mean, and the
stored global equals, bit for bit, the in-process simulation of the same task (the rotation's
seed derives from fleet, task, round, phase, device and global, so both sides draw the same).
With ``downlink = 4`` the global also goes down as codes, and still agrees bit for bit."""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import pytest

from cloud_aggregator.local.fleet import aggregator_toml
from cloud_aggregator.rounds.simulation import ClientData, simulate
from cloud_aggregator.store.sqlite import SqliteStore
from edge.dataset import save_dataset
from trainer_lite.data import Dataset
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

DEVICES = ["cell1", "cell2", "cell3"]
TASK = {
    "name": "packed",
    "algorithm": "fedavg",
    "model": "mlp",
    "model_args": {"sizes": [8, 16, 2]},
    "hparams": {"lr": 0.05, "local_steps": 3},
    "rounds": 3,
    "seed": 5,
    "compress": {"bits": 1},
}


def _clients() -> dict[str, ClientData]:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 2))
    out = {}
    for device in DEVICES:
        x = rng.standard_normal((40, 8))
        y = x @ w + 0.3 * rng.standard_normal((40, 2))
        out[device] = ClientData(Dataset(x[:30], y[:30]), Dataset(x[30:], y[30:]))
    return out


#: 1 bit up, the global 4 bits down (``ioft_protocol.downlink``): each device decodes the codes
#: of the announcement to the global the aggregator's phase runs on.
DOWN_TASK = {**TASK, "compress": {"bits": 1, "downlink": 4}}


@pytest.mark.broker
@pytest.mark.parametrize("task", [TASK, DOWN_TASK], ids=["uplink", "both_ways"])
def test_one_bit_uploads_over_mqtt_match_the_in_process_simulation(fleet_procs, task):
    clients = _clients()
    for device, data in clients.items():
        save_dataset(fleet_procs.work / device, data.train, data.test, {"source": "test"})
        fleet_procs.start_device(device, simulate=None)
    fleet_procs.start_aggregator(
        aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES)
    )
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")[-3000:]

    records = fleet_procs.rounds("packed")
    assert [(r.round, r.status) for r in records] == [(r, "completed") for r in (1, 2, 3)], records
    assert all(sorted(r.participants) == DEVICES and not r.rejected for r in records)
    store = SqliteStore(fleet_procs.db, readonly=True)
    try:
        over_mqtt = store.resume_point("packed")[2]
    finally:
        store.close()

    spec = TaskSpec.from_json(json.dumps(task))
    in_process, _, sim_records = simulate(spec, clients)
    assert param_hash(over_mqtt) == param_hash(in_process)
    assert [r.global_hash for r in records] == [r.global_hash for r in sim_records]
    uncompressed, _, _ = simulate(TaskSpec.from_json(json.dumps({**TASK, "compress": None})), clients)
    assert param_hash(uncompressed) != param_hash(over_mqtt)  # the codes, not the floats, were summed
    if task is DOWN_TASK:  # and the devices trained from the 4-bit global, not the float one
        up_only, _, _ = simulate(TaskSpec.from_json(json.dumps(TASK)), clients)
        assert param_hash(up_only) != param_hash(over_mqtt)


def _final(fleet_procs, task: str):
    store = SqliteStore(fleet_procs.db, readonly=True)
    try:
        return store.resume_point(task)[2]
    finally:
        store.close()


@pytest.mark.broker
@pytest.mark.parametrize("task", [TASK, DOWN_TASK], ids=["uplink", "both_ways"])
def test_one_bit_uploads_folded_by_two_workers_match_the_in_process_simulation(fleet_procs, task):
    """``[collect] workers = 2``: each worker's admission decodes the codes it is handed straight
    into its partial sum; the coordinator's merge is the simulator's one fold, bit for bit (with a
    compressed downlink the workers decode the announcement to the round's global as devices do)."""
    from tests.e2e.test_aggregator_workers import start_worker

    clients = _clients()
    for device, data in clients.items():
        save_dataset(fleet_procs.work / device, data.train, data.test, {"source": "test"})
        fleet_procs.start_device(device, simulate=None)
    toml = aggregator_toml(
        fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES, deadline_s=120
    ).replace("[collect]\n", "[collect]\nworkers = 2\nspawn_workers = false\n")
    fleet_procs.start_aggregator(toml)
    workers = [start_worker(fleet_procs, fleet_procs.work / "aggregator.toml", w) for w in ("w1", "w2")]
    try:
        assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")[-3000:]
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
                w.wait(10)
    records = fleet_procs.rounds("packed")
    assert [(r.round, r.status, sorted(r.participants)) for r in records] == [
        (r, "completed", DEVICES) for r in (1, 2, 3)
    ], records
    in_process, _, _ = simulate(TaskSpec.from_json(json.dumps(task)), clients)
    assert param_hash(_final(fleet_procs, "packed")) == param_hash(in_process)
    admitted = [
        int(n)
        for w in ("w1", "w2")
        for n in re.findall(r"stopped: (\d+) uploads admitted", fleet_procs.log(f"worker-{w}"))
    ]
    assert sum(admitted) == 3 * len(DEVICES), admitted  # the workers, not serve, decoded every upload


SECAGG_TASK = {
    **TASK,
    "name": "maskedpacked",
    "server": {"weighting": "uniform"},
    "secagg": {"threshold": 0.6, "clip": 0.05},
}


@pytest.mark.broker
@pytest.mark.parametrize("down", [None, 4], ids=["uplink", "both_ways"])
def test_secagg_rounds_of_one_bit_codes_over_mqtt_match_the_in_process_simulation(fleet_procs, down):
    """``[task.secagg]`` with ``[task.compress] bits = 1``: each device's masked ring vector holds
    its codes on the round's shared rotation and grid; the aggregator unmasks their exact sum, so
    the global is the simulator's (whose SecAgg round runs the same state machines in-process).
    ``downlink = 4``: the changes are taken from the decoded global on both sides."""
    task = SECAGG_TASK if down is None else {**SECAGG_TASK, "compress": {"bits": 1, "downlink": down}}
    clients = _clients()
    for device, data in clients.items():
        save_dataset(fleet_procs.work / device, data.train, data.test, {"source": "test"})
        fleet_procs.start_device(device, simulate=None)
    fleet_procs.start_aggregator(
        aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES)
    )
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")[-3000:]
    records = fleet_procs.rounds("maskedpacked")
    assert [(r.round, r.status, sorted(r.participants)) for r in records] == [
        (r, "completed", DEVICES) for r in (1, 2, 3)
    ], records
    in_process, _, sim_records = simulate(TaskSpec.from_json(json.dumps(task)), clients)
    assert param_hash(_final(fleet_procs, "maskedpacked")) == param_hash(in_process)
    assert [r.global_hash for r in records] == [r.global_hash for r in sim_records]

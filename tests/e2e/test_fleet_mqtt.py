"""A real fleet: mosquitto + `cloud-aggregator serve` + three `edge-trainer` processes."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from cloud_aggregator.local.fleet import FLEET, Sniffer, aggregator_toml, pflda_task
from cloud_aggregator.store.sqlite import SqliteStore
from edge.dataset import load_dataset
from ioft_protocol import codec

DEVICES = ["printer1", "printer2", "printer3"]
#: Every field an announcement or update may carry besides its tensors.
WIRE_FIELDS = {
    *("v", "kind", "fleet", "task", "round", "phase", "global_hash", "deadline", "spec", "state"),
    *("params_hash", "for_device", "personalized", "participants", "device", "n_samples", "metrics"),
}


@pytest.mark.broker
@pytest.mark.any_broker
def test_fleet_trains_over_mqtt_and_leaks_nothing_personal(fleet_procs):
    task = pflda_task()
    sniffer = Sniffer(fleet_procs.broker_url)
    try:
        for d in DEVICES:
            fleet_procs.start_device(d)
        fleet_procs.start_aggregator(
            aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES)
        )
        assert fleet_procs.wait_aggregator(90) == 0, fleet_procs.log("aggregator")
    finally:
        sniffer.stop()

    # Every round is in SQLite, every device took part, and the fleet's test loss fell.
    store = SqliteStore(fleet_procs.db)
    records = store.rounds("speed")
    store.close()
    assert [r.round for r in records] == list(range(1, task["rounds"] + 1))
    assert all(r.status == "completed" and sorted(r.participants) == DEVICES for r in records)
    assert all(len(r.global_hash) == 64 for r in records)
    first, last = records[0].mean_metric("test_loss"), records[-1].mean_metric("test_loss")
    assert last < 0.5 * first, (first, last)

    # Privacy invariant: only the shared decoder ever travelled; no personal parameter, no raw sample.
    uplinks = [(t, p) for t, p in sniffer.messages if "/up/" in t]
    assert len(uplinks) >= len(DEVICES) * task["rounds"]
    raw_values = []
    for d in DEVICES:
        train, test, _ = load_dataset(fleet_procs.work / d)
        raw_values += [train.x, train.y, test.x, test.y]
    for topic, payload in sniffer.messages:
        if "/task/" in topic:
            meta, tensors = codec.decode(payload)
            assert set(tensors) <= {"decoder.weight", "decoder.bias"}, (topic, sorted(tensors))
            assert set(meta) <= WIRE_FIELDS, meta  # no field beyond the protocol's
        else:
            assert b"encoder" not in payload and b"personal" not in payload, topic
        for arr in raw_values:
            for dtype in (np.float32, np.float64):
                # Any two consecutive raw values, as bytes, would betray a sample.
                flat = arr.astype(dtype).ravel()
                for i in range(0, len(flat) - 1, 7):
                    assert flat[i : i + 2].tobytes() not in payload, (topic, i)

    # Devices announced themselves online (retained status) and the aggregator saw them.
    statuses = [json.loads(p) for t, p in sniffer.messages if t.startswith(f"ioft/v1/{FLEET}/status/") and p]
    assert {s["device"] for s in statuses if s["state"] == "online"} == set(DEVICES)


@pytest.mark.broker
def test_device_stops_cleanly_on_sigterm_and_resumes_its_state(fleet_procs):
    task = pflda_task(rounds=3)
    for d in DEVICES[:2]:
        fleet_procs.start_device(d)
    fleet_procs.start_aggregator(
        aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=DEVICES[:2])
    )
    assert fleet_procs.wait_aggregator(60) == 0
    proc = fleet_procs.devices["printer1"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    # State on disk is consistent: the last answered round and its upload are there.
    from ioft_protocol.state import load_arrays

    arrays, meta = load_arrays(fleet_procs.work / "printer1" / "tasks" / "speed" / "local.safetensors")
    assert meta["answered"] == [3, "train"]
    assert {"upload.decoder.weight", "upload.decoder.bias", "local.encoder.scale"} <= set(arrays)

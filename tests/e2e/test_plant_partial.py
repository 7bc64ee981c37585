"""A plant-level partial aggregator over two real mosquittos bridged on loopback.

Four ``edge-trainer`` processes connect to the plant's broker, two to the cloud's.  The plant's
bridge carries ``bridge_topic_lines(partial=True)``: statuses out, announcements and the
coordinator's control messages in, and the plant worker's batches out, but not the devices'
uploads.  ``cloud-aggregator worker --plant`` at the plant admits its four devices' uploads and
sends one batch per round; two workers spawned by ``serve`` at the cloud share the two direct
devices' uploads.  Counted on the cloud broker: no plant device's upload crosses, one plant
batch per round does; and the final model is the in-process simulation's, bit for bit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from cloud_aggregator import faults
from cloud_aggregator.fleet.plant_files import bridge_topic_lines
from cloud_aggregator.local.broker import LOOPBACK_CONF, free_port, start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet, Sniffer, aggregator_toml
from cloud_aggregator.rounds.simulation import simulate
from cloud_aggregator.serve import worker_wire as wire
from cloud_aggregator.store.sqlite import SqliteStore
from edge.dataset import save_dataset
from ioft_protocol import topics
from tests.e2e.test_aggregator_workers import DEVICES, TASK, client_data
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

PLANT, DIRECT = DEVICES[:4], DEVICES[4:]


@pytest.mark.broker
@pytest.mark.slow
def test_one_partial_per_round_crosses_the_bridge(tmp_path):
    cloud = start_mosquitto(free_port(), log_file=tmp_path / "cloud.log")
    port = free_port()
    conf = tmp_path / "plant.conf"
    conf.write_text(
        LOOPBACK_CONF.format(port=port)
        + f"connection cloud\naddress 127.0.0.1:{cloud.url.rsplit(':', 1)[1]}\n"
        + "cleansession false\nlocal_cleansession false\nbridge_protocol_version mqttv311\n"
        + "\n".join(bridge_topic_lines(FLEET, partial=True))
        + "\n"
    )
    plant = start_mosquitto(port, config=conf, log_file=tmp_path / "plant.log")
    sniffer = Sniffer(cloud.url)
    at_cloud = LocalFleet(tmp_path, cloud.url)
    at_plant = LocalFleet(tmp_path, plant.url)
    worker = None
    try:
        clients = client_data(np.random.default_rng(0))
        for device, data in clients.items():
            save_dataset(tmp_path / device, data.train, data.test, {"source": "test"})
            (at_plant if device in PLANT else at_cloud).start_device(device, simulate=None)
        toml = aggregator_toml(
            cloud.url, tmp_path / "aggregator", [TASK], expected=DEVICES, deadline_s=120
        ).replace("[collect]\n", "[collect]\nworkers = 2\n")
        at_cloud.start_aggregator(toml)
        with (tmp_path / "worker-plant.log").open("ab") as log:
            cli = [sys.executable, "-m", "cloud_aggregator.cli", "worker"]
            args = [
                "--config",
                str(tmp_path / "aggregator.toml"),
                "--broker",
                plant.url,
                "--plant",
                "--id",
                "plant-a",
            ]
            worker = subprocess.Popen(
                [*cli, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**faults.child_env(None), "PYTHONUNBUFFERED": "1"},
            )
        assert at_cloud.wait_aggregator(240) == 0, at_cloud.log("aggregator")[-3000:]
        # The sniffer reads the broker on its own connection: it may lag the aggregator, so wait
        # until it saw what the rounds used (each plant batch, each direct device's upload).
        at_cloud.wait_for(
            lambda: len(_plant_batches(sniffer)) >= TASK["rounds"] and _up_from(sniffer) >= set(DIRECT),
            60,
            "the sniffer seeing every plant batch and direct upload",
        )
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(10)
        sniffer.stop()
        at_plant.stop_all()
        at_cloud.stop_all()
        plant.stop()
        cloud.stop()

    records = at_cloud.rounds(TASK["name"])
    assert [(r.status, sorted(r.participants)) for r in records] == [("completed", DEVICES)] * TASK["rounds"]
    assert _up_from(sniffer) == set(DIRECT)  # no plant device's upload reached the cloud broker
    assert len(_plant_batches(sniffer)) == TASK["rounds"]  # one message per plant per round
    store = SqliteStore(tmp_path / "aggregator" / "aggregator.sqlite", readonly=True)
    try:
        final = store.resume_point(TASK["name"])[2]
    finally:
        store.close()
    reference, _, _ = simulate(TaskSpec.from_json(json.dumps(TASK)), clients)
    assert param_hash(final) == param_hash(reference)


def _up_from(sniffer: Sniffer) -> set[str]:
    """The devices whose uploads the sniffer saw on the cloud broker."""
    prefix = f"{topics.PROTOCOL}/{FLEET}/task/"
    return {t.rsplit("/", 1)[1] for t, _ in list(sniffer.messages) if t.startswith(prefix) and "/up/" in t}


def _plant_batches(sniffer: Sniffer) -> list[str]:
    """The plant worker's batches the sniffer saw on the cloud broker."""
    return [t for t, _ in list(sniffer.messages) if t == wire.topic_batch(FLEET, TASK["name"], "plant-a")]

"""Models at work, on real processes and a real mosquitto: ``edge-recorder --simulate`` feeds every new
layer or weld to ``edge-trainer``, whose serving model answers it on the device's answer topic.

Each test first records a few rows (the dataset), lets the fleet train, then records more: every
row of that second run gets exactly one answer, from the model the trainer last let through its gate:
the best of its candidates on its newest rows, which each answer names.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_aggregator.local.fleet import FLEET, Sniffer, aggregator_toml, pflda_task
from edge.dataset import load_dataset
from edge.feed import feed_path
from edge.jsonlog import read_log
from ioft_protocol import topics
from tests.e2e.retained import retained_status
from trainer_lite.data import holdout_size

WELD_TASK = {
    "name": "tool",
    "algorithm": "fedavg",
    "model": "mlp",
    "rounds": 2,
    "seed": 0,
    "model_args": {"sizes": [624, 16, 4], "init": "kaiming"},
    "hparams": {"lr": 0.01, "loss": "cross_entropy", "local_steps": 5, "batch_size": 8, "scaling": "local"},
}


def record(work: Path, device: str, kind: str, *args: str) -> None:
    """One ``edge-recorder --simulate KIND`` run to its end (the print, or the welds)."""
    done = subprocess.run(
        [sys.executable, "-m", "edge.recording.cli", "--simulate", kind, "--device", device,
         "--state-dir", str(work / device), "--log-level", "WARNING", *args],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def answers(sniffer: Sniffer, device: str, task: str) -> list[dict]:
    topic = topics.topic_answer(FLEET, device, task)
    return [json.loads(p) for t, p in list(sniffer.messages) if t == topic]


def train(fleet, device: str, task: dict, rounds: int, folder: str = "aggregator") -> None:
    """Start the trainer (if not running) and an aggregator for ``task``; wait until it is done."""
    if device not in fleet.devices:
        fleet.start_device(device, "--log-level", "INFO", simulate=None)
    toml = aggregator_toml(
        fleet.broker_url, fleet.work / folder, [task], expected=[device], startup_wait_s=30
    )
    fleet.start_aggregator(toml, name=folder)
    assert fleet.wait_aggregator(180) == 0, fleet.log(folder)[-3000:]
    fleet.wait_for(
        lambda: (
            f"serves its model of round {rounds}" in fleet.log(device)
            or "does not serve" in fleet.log(device)
        ),
        30,
        f"{device}'s round {rounds} model reaching the gate",
    )


def check_answer(a: dict, device: str, task: str, rows_by_key: dict) -> None:
    row = rows_by_key[a["key"]]
    assert (a["device"], a["task"], a["row_time"]) == (device, task, row["time"])
    assert a["latency_s"] >= 0 and a["answered_at"] >= a["row_time"]
    assert a["model"]["task"] == task and len(a["model"]["digest"]) == 12


@pytest.mark.broker
def test_every_printer_layer_is_answered(fleet_procs):
    work, dev = fleet_procs.work, "p1"
    record(work, dev, "printer", "--layers", "6", "--layer-s", "0.3")
    train(fleet_procs, dev, pflda_task(rounds=2), 2)
    # The rounds trained without the newest layers of the training split, which judge the models.
    stored, _, _ = load_dataset(work / dev)
    assert len(stored) >= 2
    held = holdout_size(len(stored))
    assert [r.n_samples[dev] for r in fleet_procs.rounds("speed")] == [len(stored) - held] * 2
    sniffer = Sniffer(fleet_procs.broker_url)
    try:
        record(work, dev, "printer", "--layers", "8", "--layer-s", "0.3")
        fed = [r for r in read_log(feed_path(work / dev))[0] if "#2/" in r["key"]]  # the second print run
        assert len(fed) >= 6
        fleet_procs.wait_for(
            lambda: len(answers(sniffer, dev, "speed")) >= len(fed), 30, "an answer per layer"
        )
    finally:
        sniffer.stop()
    got = answers(sniffer, dev, "speed")
    by_key = {r["key"]: r for r in fed}
    assert sorted(a["key"] for a in got) == sorted(by_key)  # one answer per layer, no more
    for a in got:
        check_answer(a, dev, "speed", by_key)
        assert a["kind"] == "layer" and a["model"]["round"] == 2
        assert math.isfinite(a["expected_speed"]) and a["commanded"] == by_key[a["key"]]["commanded"]
        assert a["residual"] == pytest.approx(a["expected_speed"] - a["commanded"])
    # The same answers in the device's local log; the status counts them and names the serving model.
    logged = [r for r in read_log(work / dev / "serving" / "answers.jsonl")[0] if r["key"] in by_key]
    assert sorted(r["key"] for r in logged) == sorted(by_key)
    fleet_procs.wait_for(
        lambda: (
            retained_status(fleet_procs.broker_url, dev)
            .get("serving", {})
            .get("answered", {})
            .get("speed", 0)
            >= len(fed)
        ),
        30,
        "the status counting the answers",
    )
    serving = retained_status(fleet_procs.broker_url, dev)["serving"]
    assert serving["models"]["speed"]["digest"] == got[0]["model"]["digest"]
    # Every answer names the candidate that gave it; the status, why it serves (edge.serving.candidates).
    served = serving["models"]["speed"]
    assert {a["candidate"] for a in got} == {served["candidate"]} <= {"personal", "global", "alone"}
    evidence = served["evidence"]
    assert set(evidence["scores"]) == {"personal", "global", "alone"} and evidence["rows"] == held
    assert evidence["metric"] == "r2" and evidence["why"]


@pytest.mark.broker
def test_every_weld_is_answered_labelled_or_not(fleet_procs):
    work, dev = fleet_procs.work, "w1"
    record(work, dev, "welder", "--welds", "12", "--weld-s", "0.05")
    train(fleet_procs, dev, WELD_TASK, 2)
    sniffer = Sniffer(fleet_procs.broker_url)
    try:
        record(work, dev, "welder", "--welds", "8", "--weld-s", "0.1")
        fed = [r for r in read_log(feed_path(work / dev))[0] if r["kind"] != "label"][
            -8:
        ]  # labels ride along
        fleet_procs.wait_for(lambda: len(answers(sniffer, dev, "tool")) >= 8, 30, "an answer per weld")
    finally:
        sniffer.stop()
    got = answers(sniffer, dev, "tool")
    by_key = {r["key"]: r for r in fed}
    assert sorted(a["key"] for a in got) == sorted(by_key)
    pending = json.loads((work / dev / "recorder-status.json").read_text())["pending_welds"]
    assert pending >= 2  # every fourth weld is never labelled: answered all the same, not stored
    for a in got:
        check_answer(a, dev, "tool", by_key)
        assert a["kind"] == "weld" and a["classes"] == ["TC1", "TC2", "TC3", "TC4"]
        assert a["candidate"] in ("personal", "global", "alone")
        assert sum(a["probabilities"]) == pytest.approx(1.0, abs=1e-5) and a["predicted"] in a["classes"]


@pytest.mark.broker
def test_the_gate_keeps_the_better_model_serving(fleet_procs):
    """A task started over with a learning rate that cannot learn: its model scores worse on the
    device's test split, so the trained one keeps answering (and the status says why)."""
    work, dev = fleet_procs.work, "p1"
    record(work, dev, "printer", "--layers", "10", "--layer-s", "0.2")
    train(fleet_procs, dev, pflda_task(rounds=3), 3)
    trained = retained_status(fleet_procs.broker_url, dev)["serving"]["models"]["speed"]
    worse = pflda_task(rounds=1, seed=7) | {"hparams": {"lr": 1e-9, "local_steps": 1}}
    train(fleet_procs, dev, worse, 1, folder="aggregator2")
    fleet_procs.wait_for(lambda: "does not serve" in fleet_procs.log(dev), 30, "the gate refusing round 1")
    sniffer = Sniffer(fleet_procs.broker_url)
    try:
        record(work, dev, "printer", "--layers", "4", "--layer-s", "0.2")
        fleet_procs.wait_for(lambda: len(answers(sniffer, dev, "speed")) >= 3, 30, "answers")
    finally:
        sniffer.stop()
    assert {a["model"]["digest"] for a in answers(sniffer, dev, "speed")} == {trained["digest"]}
    status = retained_status(fleet_procs.broker_url, dev)["serving"]
    assert status["models"]["speed"]["digest"] == trained["digest"]
    assert status["gate"]["speed"].startswith("round 1:")

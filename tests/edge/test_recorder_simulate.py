"""``edge-recorder --simulate printer``: the real recorder on a simulated printer, run as a process,
stops by itself after its print and leaves a dataset of the print's layers; ``--simulate welder``
with a welder ``[sensors]`` table; and ``edge-trainer --simulate``'s live recorder thread."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge.dataset import load_dataset

ROOT = Path(__file__).resolve().parents[2]


def test_simulate_printer_records_the_simulated_print_and_stops(tmp_path):
    state = tmp_path / "sim"
    cmd = ["-m", "edge.recording.cli", "--simulate", "printer", "--layers", "6", "--layer-s", "0.6"]
    out = subprocess.run(
        [sys.executable, *cmd, "--state-dir", str(state)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    loaded = load_dataset(state)
    assert loaded is not None, out.stderr[-3000:]
    train, test, meta = loaded
    assert 1 <= len(train) + len(test) <= 6 and meta["source"] == "record-printer"
    # Layer i of the simulated print runs at 30 + i mm/s: every row is one of its six layers.
    speeds = np.concatenate([train.y[:, 0], test.y[:, 0]]) * 50
    layer = np.round(speeds - 30)
    np.testing.assert_allclose(speeds, 30 + layer, atol=1e-6)
    assert set(layer) <= set(range(6))


def test_without_simulate_device_and_config_are_required(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "edge.recording.cli"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "--simulate printer" in out.stderr


def test_simulate_welder_takes_a_welder_sensors_table_without_folder_or_log(tmp_path):
    # --simulate supplies its own folder and log: a [sensors] kind = "welder" needs neither.
    toml = tmp_path / "welder.toml"
    toml.write_text('[sensors]\nkind = "welder"\ntest_fraction = 0.0\n')
    state = tmp_path / "w"
    cmd = ["--simulate", "welder", "--config", str(toml), "--device", "welder7", "--state-dir", str(state)]
    out = subprocess.run(
        [sys.executable, "-m", "edge.recording.cli", *cmd, "--welds", "2", "--weld-s", "0.2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    train, _, meta = load_dataset(state)
    assert len(train) == 2 and meta["source"] == "record-welder"


def test_live_simulation_appends_to_the_simulated_history_and_feeds_every_row(tmp_path):
    """``edge-trainer --simulate printer``'s recorder thread: the recorder's own path, under the
    history's tag, each stored layer also handed to the serving model's feed."""
    import argparse

    from edge.config import DataConfig
    from edge.dataset import prepare_dataset
    from edge.feed import feed_path
    from edge.jsonlog import read_log
    from edge.recording.simulate_live import LiveSimulation

    train, test, _ = prepare_dataset(tmp_path, "printer7", DataConfig(source="simulate-printer"))
    history = len(train) + len(test)
    args = argparse.Namespace(layers=3, layer_s=0.4)
    live = LiveSimulation("printer", "printer7", tmp_path, args, "simulate-printer")
    live.start()
    deadline = time.monotonic() + 60  # a guard only: the test waits for rows, not for a time
    while live.prints < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    live.stop()
    train, test, meta = load_dataset(tmp_path)
    assert live.prints >= 2 and meta["source"] == "simulate-printer"
    rows = [r for r in read_log(feed_path(tmp_path))[0] if r.get("kind") == "layer"]
    assert len(rows) >= 3 and len(train) + len(test) - history == len(rows)


def test_a_rehearsal_printer_records_on_as_the_machine_its_history_came_from(tmp_path):
    """With its seeded history's metadata (``edge-trainer --simulate printer``), each live print is a
    run of that printer's own simulated machine at its training settings in turn: the speeds and
    vibration its history holds, not the recorder's fixed ramp (which every printer printed alike,
    and which no printer's history holds)."""
    import argparse

    from edge.config import DataConfig
    from edge.dataset import prepare_dataset
    from edge.feed import feed_path
    from edge.jsonlog import read_log
    from edge.recording.simulate_live import LiveSimulation
    from edge.simulated import live_printer_plan

    _, _, meta = prepare_dataset(tmp_path, "printer3", DataConfig(source="simulate-printer"))
    args = argparse.Namespace(layers=3, layer_s=0.4)
    live = LiveSimulation("printer", "printer3", tmp_path, args, "simulate-printer", meta)
    live.start()
    deadline = time.monotonic() + 60  # a guard only: the test waits for rows, not for a time
    while live.prints < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    live.stop()
    rows = [r for r in read_log(feed_path(tmp_path))[0] if r.get("kind") == "layer"]
    for k in range(2):  # the first two prints, whole
        job, plan = live_printer_plan("printer3", meta, k, 3)
        assert job == f"live_speed{meta['train_speeds'][k]}.gcode"
        got = [r for r in rows if r["key"].startswith(job)]
        assert len(got) == 3, rows
        for row, (speed, sx, sy) in zip(got, plan, strict=True):
            assert row["commanded"] == pytest.approx(speed, rel=1e-3)
            # σ_a, as the driver reads it off the chip
            assert row["x"] == pytest.approx([np.hypot(sx, sy)], rel=0.25)
    assert not any(r["commanded"] == pytest.approx(30.0) for r in rows)  # never the ramp's first layer


def test_the_trainer_refuses_to_simulate_into_a_recorded_dataset(tmp_path):
    # A real (or edge-recorder's) dataset never gets a simulated machine's rows: one line, exit 2.
    from edge.recording.printer import PRINTER_SOURCE
    from edge.segment_writer import write_base

    empty = np.zeros((1, 1))
    write_base(tmp_path, {"train_x": empty, "train_y": empty, "test_x": empty, "test_y": empty},
               {"source": PRINTER_SOURCE})  # fmt: skip
    cmd = ["--device", "printer7", "--simulate", "printer", "--state-dir", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", "edge.cli", *cmd, "--broker", "mqtt://127.0.0.1:9", "--allow-plaintext"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "'record-printer'" in out.stderr and "--state-dir" in out.stderr


def test_a_live_welder_keeps_only_its_newest_weld_files(tmp_path):
    from edge.recording.simulate import SimulatedWelder

    sim = SimulatedWelder("welder7", tmp_path, 5, 0.05, lead_s=0.0, keep=2)
    sim.inbox.mkdir(parents=True)  # as recorder() makes it
    sim.start()
    deadline = time.monotonic() + 60  # a guard only
    while sim.exported < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    sim.close()
    left = {p.name.split(".")[0][-3:] for p in sim.inbox.iterdir()}  # weld ids end in their index
    assert sim.exported == 5 and left == {"003", "004"}, sorted(p.name for p in sim.inbox.iterdir())

"""``edge-recorder --simulate printer``: the real recorder on a simulated printer, run as a process,
stops by itself after its print and leaves a dataset of the print's layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

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

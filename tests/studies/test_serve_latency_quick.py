"""benchmarks.serve_latency, tiny: every weld dropped into the watched folder and every layer the
simulated print stores is answered at the subscriber (the ledger, not the timings, is checked)."""

from __future__ import annotations

import math

import pytest

from benchmarks import serve_latency


@pytest.mark.broker
@pytest.mark.slow
def test_every_row_of_the_benchmark_is_answered(tmp_path):
    welds, layers = serve_latency.run(welds=4, layers=4, work=tmp_path)
    assert welds["answered"] == welds["rows"] == 4
    assert layers["answered"] == layers["rows"] >= 2  # a layer cut short by load is dropped, not fed
    assert all(math.isfinite(v) for v in (*welds["e2e"], *layers["e2e"]))


def test_the_arm64_launcher_runs_in_the_root_and_names_paths_as_seen_there(tmp_path):
    root = tmp_path / "root"
    launcher = serve_latency.Launcher(root=root, python="/opt/ioft-venv/bin/python")
    assert launcher.argv(["edge.cli", "--device", "w1"]) == [
        "chroot", str(root), "/opt/ioft-venv/bin/python", "-m", "edge.cli", "--device", "w1",
    ]  # fmt: skip
    assert launcher.path(root / "var" / "tmp" / "w1") == "/var/tmp/w1"
    assert serve_latency.HOST.path(tmp_path / "w1") == str(tmp_path / "w1")

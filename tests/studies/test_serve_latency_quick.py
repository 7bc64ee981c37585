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


def _layer_row(kind: str, p99_ms: float, load: float) -> dict:
    nan = (float("nan"),) * 3
    return {
        "kind": kind, "rows": 20, "answered": 20, "e2e": (1.0, p99_ms, p99_ms), "serve": (0.4, 0.7, 0.9),
        "found": nan, "cpu_trainer_ms": 1.2, "cpu_recorder_ms": float("nan"), "rss_added_mib": 2.5,
        "target_ms": 5.0, "load": load,
    }  # fmt: skip


def test_the_hung_moonraker_report_has_the_arm64_section_beside_the_hosts():
    from benchmarks import serve_latency_hung

    def one_run(p99: float, load: float) -> list[dict]:
        return [_layer_row("printer layer, advice published only", p99, load),
                _layer_row("printer layer, advice to a Moonraker that never answers", p99 + 1, load)]  # fmt: skip

    host = [one_run(2.0, 0.5), one_run(3.0, 1.5)]
    assert "arm64" not in serve_latency_hung.report(host)
    body = serve_latency_hung.report(host, [one_run(40.0, 1.8)], "aarch64 Python 3.11.2 in /r", 20)
    host_part, arm_part = body.split("### arm64, emulated")
    assert "2 runs" in host_part and "2.00@0.5 3.00@1.5" in host_part and "3.00@0.5 4.00@1.5" in host_part
    assert "not a Raspberry Pi's timings" in arm_part and "aarch64 Python 3.11.2 in /r" in arm_part
    assert "1 run of 20 layers of 1 s" in arm_part
    assert "40.00@1.8" in arm_part and "41.00@1.8" in arm_part and "| NO  |" in arm_part
    assert serve_latency_hung.arm64_layers(100) == 20 and serve_latency_hung.arm64_layers(30) == 10

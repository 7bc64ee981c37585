"""The model-push benchmark runs end to end (real mosquitto, edge-trainer processes, raw paho receivers)
and its CPU figures order as they must; no times are asserted."""

from __future__ import annotations

from benchmarks import model_push
from tests.conftest import _require_mosquitto


def test_quick_model_push_measures_device_and_raw_receive_cpu():
    _require_mosquitto()
    out = model_push.main(["--quick", "--no-write"])
    small, large = out["sizes"]
    assert small["bytes"] < large["bytes"]
    for s in (small, large):
        # A device receives the same bytes as a raw subscriber and then parses, hashes and writes them.
        assert 0 < s["raw_chunks_cpu"] < s["fetch_cpu"] <= s["until_active_cpu"]
        assert s["raw_whole_cpu"] > 0
    assert large["fetch_cpu"] > small["fetch_cpu"] and large["raw_chunks_cpu"] > small["raw_chunks_cpu"]

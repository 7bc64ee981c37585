"""benchmarks.compress_downlink --quick: 1 bit up and 4 bits down make a round's payloads ≥ 8× below float32's."""

from __future__ import annotations

from benchmarks import compress_downlink


def test_quick_compress_downlink_counts_a_rounds_bytes_both_ways():
    rows = compress_downlink.main(["--quick", "--no-write"])["bytes"]
    assert rows[None]["round"] / rows[(1, 4)]["round"] >= 8
    assert rows[(1, 4)]["down"] < rows[(1, 8)]["down"] < rows[1]["down"] == rows[None]["down"]

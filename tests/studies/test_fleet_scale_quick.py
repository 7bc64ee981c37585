"""benchmarks.fleet_scale --quick: a streaming (mean) aggregator's peak RSS is flat in N, where a
strategy that holds every upload (the median) grows with N; memory only, never times."""

from __future__ import annotations

import pytest

from benchmarks import fleet_scale


@pytest.mark.broker
@pytest.mark.slow
def test_streaming_aggregator_memory_is_flat_in_n():
    out = fleet_scale.main(["--quick", "--no-write"])
    rss = {(r["strategy"], r["n"]): r["agg_rss"] for r in out["results"]}
    # 36 more uploads of 200 kB: the bound for the mean family (≤ 1.2× the small fleet's) ...
    assert rss["mean", 40] <= 1.2 * rss["mean", 4], rss
    # ... which the same run shows it can fail: the median keeps every upload (and float64 deltas).
    assert rss["median", 40] >= 1.3 * rss["mean", 4], rss
    # Every measured round had all N uploads: run_case raises otherwise.  (The broker's byte
    # count is read between polled snapshots, so per round it may fall a little short of the
    # payload: not asserted.)
    assert all("failed" not in r for r in out["results"]), out["results"]

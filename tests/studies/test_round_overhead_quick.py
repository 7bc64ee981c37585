"""The round-overhead benchmark runs end to end: real mosquitto, aggregator and edge-trainer processes."""

from __future__ import annotations

import math

from benchmarks import round_overhead
from tests.conftest import _require_mosquitto


def test_quick_round_overhead_measures_full_rounds():
    _require_mosquitto()
    out = round_overhead.main(["--quick", "--no-write"])
    assert [(r["n"], r["p"]) for r in out["results"]] == [(3, 1_000), (3, 150_000)]
    for r in out["results"]:
        # Every measured round had all 3 uploads (run_case raises otherwise) and finished well
        # inside the 60 s deadline it would otherwise have waited for.
        assert 0 < r["round_s_max"] < 30
        # Broker bytes are counted over whole rounds (idle broker to idle broker), so the payload
        # the rounds must have carried is a floor: a window that cuts rounds can read below it.
        assert r["broker_bytes"] >= r["raw_broker"]
        assert r["broker_bytes"] / r["raw_broker"] < (1.05 if r["p"] >= 150_000 else 1.5)
        assert math.isfinite(r["device_rss"]) and r["device_rss"] > 0

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

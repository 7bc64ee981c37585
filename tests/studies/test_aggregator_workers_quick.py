"""benchmarks.aggregator_workers --quick: serve with two workers sharing the uplink ends with the
same model as serve alone, bit for bit (24 devices whose uploads differ, 3 rounds); never times."""

from __future__ import annotations

import pytest

from benchmarks import aggregator_workers


@pytest.mark.broker
@pytest.mark.slow
def test_two_workers_merge_to_the_single_aggregators_model():
    out = aggregator_workers.main(["--quick", "--no-write"])
    by_k = {r["k"]: r for r in out["results"]}
    assert sorted(by_k) == [1, 2]
    # Every round had all 24 uploads (run_case raises otherwise), and the globals agree exactly.
    assert by_k[2]["final"] == by_k[1]["final"]

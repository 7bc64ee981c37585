"""benchmarks.swarm_share --quick: one small run of the swarm, the raw swarm and the training alone;
orderings only (the swarm's CPU holds its training's), never a time."""

from __future__ import annotations

import pytest

from benchmarks import swarm_share


@pytest.mark.broker
@pytest.mark.slow
def test_swarm_cpu_holds_its_training():
    out = swarm_share.main(["--quick", "--no-write"])
    (case,) = out["cases"]
    assert case["n"] == 20 and case["train"] > 0, case
    # Each device-round runs the training once, and more besides (decode, persist, publish).
    assert case["swarm"] >= case["train"], case
    assert case["bound"] >= case["train"], case

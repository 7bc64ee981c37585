"""SecAgg rounds in-process: the survivors' exact sum, dropouts at every stage, abandonment."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ioft_protocol.secagg import Abandoned, AbandonReason, SecAggConfig, SecAggResult
from ioft_protocol.secagg.simulate import run_round
from tests.budget import examples
from tests.ioft_protocol.secagg_fixtures import fleet, plain_sum

CFG = SecAggConfig(threshold=0.6, clip=1.0, bits=16, max_weight=64.0)


def _check_exact(run, updates, weights, survivors):
    assert isinstance(run.outcome, SecAggResult), run.outcome
    assert run.outcome.survivors == tuple(sorted(survivors))
    values, weight = plain_sum(run.server.params, updates, weights, survivors)
    np.testing.assert_array_equal(run.outcome.total, values)  # exact: same integers, same scale
    assert run.outcome.weight == weight


def test_no_dropouts_gives_the_exact_sum_and_the_weighted_mean_to_the_step():
    updates, weights = fleet(12, 300)
    run = run_round(CFG, updates, weights)
    _check_exact(run, updates, weights, updates)
    p = run.server.params
    w = np.array([min(weights[d], p.max_weight) / p.max_weight for d in sorted(updates)])
    x = np.clip(np.array([updates[d] for d in sorted(updates)]), -1, 1)
    step = p.clip / (2 ** (p.bits - 1) - 1)
    # each device's weight and coordinates are rounded to the grid: |error| ≤ (1 + 1)·step/2 per device
    assert np.abs(run.outcome.mean() - (w @ x) / w.sum()).max() <= 12 * step / w.sum() * 2
    assert run.outcome.ledger == {"selected": 12, "keys": 12, "shares": 12, "masked": 12, "unmask": 12}


@pytest.mark.parametrize(
    ("stage", "gone", "survivors_lost"),
    [
        ("keys", {"dev-003"}, True),  # never advertised: not in the round
        ("shares", {"dev-003", "dev-007"}, True),  # left after the key exchange
        ("masked", {"dev-003", "dev-007"}, True),  # shared its seeds, never uploaded: its mask key is rebuilt
        ("unmask", {"dev-003", "dev-007"}, False),  # uploaded, then silent: its input still counts
    ],
)
def test_dropouts_at_each_stage_leave_the_exact_survivor_sum(stage, gone, survivors_lost):
    updates, weights = fleet(16, 64, seed=3)
    run = run_round(CFG, updates, weights, drop={stage: gone})
    survivors = set(updates) - gone if survivors_lost else set(updates)
    _check_exact(run, updates, weights, survivors)
    assert run.outcome.ledger[stage] == 16 - len(gone)


def test_dropouts_at_several_stages_together():
    updates, weights = fleet(20, 40, seed=4)
    drop = {"shares": {"dev-001"}, "masked": {"dev-002", "dev-011"}, "unmask": {"dev-005"}}
    run = run_round(CFG, updates, weights, drop=drop)
    _check_exact(run, updates, weights, set(updates) - {"dev-001", "dev-002", "dev-011"})
    assert run.outcome.ledger == {"selected": 20, "keys": 20, "shares": 19, "masked": 17, "unmask": 16}


@pytest.mark.parametrize(
    ("stage", "reason"),
    [
        ("shares", AbandonReason.TOO_FEW_SHARES),
        ("masked", AbandonReason.TOO_FEW_INPUTS),
        ("unmask", AbandonReason.TOO_FEW_UNMASK),
    ],
)
def test_dropouts_beyond_the_threshold_abandon_the_round_with_a_reason(stage, reason):
    updates, weights = fleet(8, 10, seed=5)  # complete graph: 8 holders, threshold 5
    gone = {f"dev-{i:03d}" for i in range(4)}
    run = run_round(CFG, updates, weights, drop={stage: gone})
    assert isinstance(run.outcome, Abandoned)
    assert run.outcome.reason is reason
    assert run.outcome.ledger[stage] == 4


def test_too_few_devices_to_hold_shares_abandon_at_the_key_exchange():
    updates, weights = fleet(6, 10, seed=6)
    run = run_round(CFG, updates, weights, drop={"keys": {f"dev-{i:03d}" for i in range(3)}})
    assert isinstance(run.outcome, Abandoned) and run.outcome.reason is AbandonReason.TOO_FEW_KEYS


@given(
    n=st.integers(4, 24),
    clip=st.floats(0.01, 100.0),
    bits=st.integers(4, 24),
    pattern=st.lists(
        st.sampled_from(["stay"] * 6 + ["keys", "shares", "masked", "unmask"]), min_size=24, max_size=24
    ),
    seed=st.integers(0, 1000),
)
@settings(max_examples=examples(15), deadline=None)
def test_any_dropout_pattern_gives_the_exact_sum_or_a_clean_abandon(n, clip, bits, pattern, seed):
    updates, weights = fleet(n, 5, seed=seed, spread=2 * clip)
    devices = sorted(updates)
    drop: dict[str, set[str]] = {}
    for d, what in zip(devices, pattern, strict=False):
        if what != "stay":
            drop.setdefault(what, set()).add(d)
    run = run_round(
        SecAggConfig(threshold=0.55, clip=clip, bits=bits, max_weight=64.0), updates, weights, drop=drop
    )
    if isinstance(run.outcome, Abandoned):
        assert run.outcome.reason in AbandonReason
        return
    lost = drop.get("keys", set()) | drop.get("shares", set()) | drop.get("masked", set())
    # a device left out at the key exchange (its neighbourhood too thin) is not a survivor either
    survivors = set(run.outcome.survivors)
    assert survivors <= set(devices) - lost
    _check_exact(run, updates, weights, survivors)

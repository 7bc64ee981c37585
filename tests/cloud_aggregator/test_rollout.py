"""Staged rollouts without a broker: the decision, canary picking, the record and its store table."""

from __future__ import annotations

import pytest

from cloud_aggregator.models.rollout import (
    CanaryResult,
    Rollout,
    RolloutError,
    State,
    Verdict,
    canary_result,
    decide,
    describe,
    parse_canary,
    pick_canaries,
)
from cloud_aggregator.models.rollout_run import latest, save
from cloud_aggregator.store.sqlite import SqliteStore


def installed(device: str, metric: float | None, base: float | None) -> CanaryResult:
    return CanaryResult(device, "installed", "", metric, base, "accuracy")


def verdict(results: list[CanaryResult], final: bool = False, min_installed: float = 0.8) -> Verdict:
    return decide(results, min_installed=min_installed, margin=0.05, base_version=1, final=final)[0]


def test_one_canary_scoring_worse_than_the_margin_stops_at_once_whatever_the_others_say():
    worse = installed("b", 0.70, 0.80)
    verdict_, reason = decide(
        [installed("a", 0.9, 0.8), worse, CanaryResult("c", "pending")],
        min_installed=0.5,
        margin=0.05,
        base_version=1,
        final=False,
    )
    assert verdict_ == Verdict.STOP and reason.startswith("b: holdout accuracy 0.7000 is below v1's 0.8000")
    assert verdict([installed("a", 0.76, 0.80), installed("b", None, 0.8)]) == Verdict.PROMOTE  # within
    assert verdict([installed("a", 0.5, None)]) == Verdict.PROMOTE  # nothing to compare with


def test_the_installed_share_decides_once_every_canary_answered_or_at_the_deadline():
    refused = CanaryResult("r", "refused", "failed its smoke test")
    pending = CanaryResult("p", "pending", "offline")
    ok = [installed(d, 0.8, 0.8) for d in "abcd"]
    assert verdict([*ok, refused]) == Verdict.PROMOTE  # 4 of 5 = 0.8
    assert verdict([*ok[:3], refused, refused]) == Verdict.STOP
    assert verdict([*ok[:2], pending, refused, refused]) == Verdict.STOP  # 0.8 is out of reach already
    assert verdict([*ok, pending]) == Verdict.WAIT
    assert verdict([*ok, pending], final=True) == Verdict.PROMOTE
    assert verdict([*ok[:3], pending, pending], final=True) == Verdict.WAIT  # left for `rollout resume`
    reason = decide([refused], min_installed=0.8, margin=0.05, base_version=1, final=False)[1]
    assert "0 of 1" in reason and "r: failed its smoke test" in reason


def test_canaries_are_counted_or_a_share_rounded_up_and_never_the_whole_pool():
    pool = [f"p{i}" for i in range(9, -1, -1)]
    assert pick_canaries("2", pool) == ("p0", "p1")
    assert pick_canaries("25%", pool) == ("p0", "p1", "p2")
    for bad in ("0", "-1", "100%", "x", "0%"):
        with pytest.raises(RolloutError):
            parse_canary(bad)
    with pytest.raises(RolloutError, match="nothing left to stage"):
        pick_canaries("2", ["a", "b"])


def _rollout(**kw) -> Rollout:
    return Rollout("enc", 2, 1, ("a", "b"), (), 0.8, 0.05, b"\x00canary", b"\x01prev", **kw)


def test_a_canary_reports_both_scores_only_for_the_version_it_replaced():
    r = _rollout()
    status = {"state": "online", "models": {"enc": {"active": 2, "previous": 1, "metric": 0.6, "previous_metric": 0.9, "metric_name": "r2"}}}  # fmt: skip
    assert canary_result("a", status, r) == CanaryResult("a", "installed", "", 0.6, 0.9, "r2")
    status["models"]["enc"]["previous"] = 0
    assert canary_result("a", status, r).base_metric is None
    assert canary_result("a", None, r).state == "pending"
    refused = {
        "state": "online",
        "models": {"enc": {"active": 1, "rejected": [{"version": 2, "reason": "no"}]}},
    }
    assert canary_result("a", refused, r) == CanaryResult("a", "refused", "no")


def test_the_record_survives_a_reopened_store_and_each_model_keeps_its_latest(tmp_path):
    store = SqliteStore(tmp_path / "aggregator.sqlite")
    first = _rollout(started_at=1.0, state=State.STOPPED, reason="a: worse")
    save(store, first)
    second = replace_version(_rollout(started_at=2.0), 3)
    second.results = {"a": {"state": "installed", "metric": 0.8, "base_metric": 0.8, "metric_name": "r2"}}
    save(store, second)
    store.close()
    again = SqliteStore(tmp_path / "aggregator.sqlite", readonly=True)
    found = latest(again)
    assert found == [second] and found[0].canary_offer == b"\x00canary"
    assert [r.state for r in map(Rollout.from_json, again.rollouts("enc"))] == [State.STOPPED, State.CANARY]
    text = describe(found[0])
    assert "enc v3 (replacing v1): canary" in text and "a: installed (r2 0.8000, was 0.8000)" in text
    assert "b: no answer yet" in text


def replace_version(r: Rollout, version: int) -> Rollout:
    r.version = version
    return r

"""The reliability study's upload accounting: every upload on the wire is counted, refused
with a recorded reason, or lost -- and a silently vanished one shows up as lost."""

from __future__ import annotations

from types import SimpleNamespace

from checks.fault_scenarios import ScenarioRun


def rec(round_: int, participants: list[str], status: str = "completed", late: list[str] | None = None):
    extra = {} if late is None else {"late": late, "superseded": []}
    return SimpleNamespace(round=round_, participants=participants, status=status, extra=extra)


def run(records, sent, refused) -> ScenarioRun:
    return ScenarioRun("t", ["fault"], records, {d: dict.fromkeys(rs) for d, rs in sent.items()}, refused)


def test_counted_late_and_refused_uploads_are_accounted_for():
    r = run(
        [rec(1, ["a", "b"]), rec(2, ["a"]), rec(3, ["a", "b"], late=["b"]), rec(4, ["a"], "abandoned")],
        {"a": [1, 2, 3, 4], "b": [1, 2, 3, 5]},  # b's round 2 counted late in 3; b's "5" was refused
        {"b": 1},
    )
    assert (r.on_wire, r.counted, r.late_counted, r.refused_late, r.lost) == (8, 7, 1, 1, 0)
    assert r.statuses() == {"completed": 3, "abandoned": 1}


def test_an_upload_neither_counted_nor_refused_is_lost():
    r = run([rec(1, ["a"]), rec(2, ["a"])], {"a": [1, 2], "b": [1, 2]}, {"b": 1})
    assert (r.counted, r.refused_late, r.lost) == (2, 1, 1)
    # A refusal recorded for another device accounts for nothing of b's.
    assert run([rec(1, ["a"])], {"a": [1], "b": [1]}, {"a": 3}).lost == 1

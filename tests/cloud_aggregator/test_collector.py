"""A round's collector (``cloud_aggregator.rounds.collector``) on its own: no broker, no sleeping.

Driven by a clock the test moves and a roster it edits, as ``MqttFleet`` drives it with
``time.time`` and the devices' statuses.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.collector import CollectPolicy, FixedRoster, RoundCollector
from cloud_aggregator.rounds.types import Reason, Refusal, Rejection, SatOut

from .test_admission import global_params, request


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def collector(
    devices=("d0", "d1"), *, roster: FixedRoster | None = None, clock: Clock | None = None, **policy
) -> tuple[RoundCollector, FixedRoster, Clock]:
    roster = roster or FixedRoster(devices)
    clock = clock or Clock()
    held_out = policy.pop("held_out", ())
    c = RoundCollector(
        request(1, global_params()),
        CollectPolicy(**{"deadline_s": 10.0, **policy}),
        roster,
        held_out=held_out,
        clock=clock,
    )
    c.open()
    return c, roster, clock


def answer(c: RoundCollector, device: str) -> None:
    c.file(device, Update(device, {}, 10, {}))


def sat_out(c: RoundCollector) -> SatOut:
    out = c.outcome()
    assert isinstance(out[-1], SatOut) and not any(isinstance(e, SatOut) for e in out[:-1])
    return out[-1]


def test_a_round_closes_answered_once_every_awaited_device_answered_without_waiting_for_the_clock():
    c, _, clock = collector()
    assert c.deadline == clock.now + 10.0 and c.expected == {"d0", "d1"}
    answer(c, "d0")
    assert c.step() == "wait"
    answer(c, "d1")
    assert c.step() == "answered"
    replies = c.outcome()
    assert sorted(u.device for u in replies if isinstance(u, Update)) == ["d0", "d1"]
    assert replies[-1].closed == "answered"


def test_at_the_deadline_a_round_with_enough_uploads_closes_and_names_who_did_not_answer(caplog):
    c, _, clock = collector(("d0", "d1", "d2"))
    answer(c, "d0")
    clock.now += 9.9
    assert c.step() == "wait" and c.left() > 0
    clock.now += 0.1
    with caplog.at_level(logging.WARNING, logger="cloud_aggregator.rounds.collector"):
        assert c.step() == "deadline"
    assert "deadline passed waiting for d1, d2" in caplog.text
    assert sat_out(c).closed == "deadline" and c.left() == 0.0


def test_too_few_uploads_at_the_deadline_extend_it_up_to_max_extensions_then_the_round_closes(caplog):
    c, _, clock = collector(min_participants=2, max_extensions=2)
    answer(c, "d0")
    first = c.deadline
    clock.now = first
    with caplog.at_level(logging.WARNING, logger="cloud_aggregator.rounds.collector"):
        assert c.step() == "extend"
    assert c.deadline == first + 10.0 and c.extensions == 1
    assert "extending the deadline (1/2)" in caplog.text
    clock.now = c.deadline - 1
    assert c.step() == "wait"
    clock.now = c.deadline
    assert c.step() == "extend" and c.extensions == 2
    clock.now = c.deadline
    assert c.step() == "deadline"  # the engine abandons it: too few
    assert sat_out(c).closed == "deadline"


def test_an_answer_during_an_extension_closes_the_round_as_answered():
    c, _, clock = collector(min_participants=2, max_extensions=1)
    answer(c, "d0")
    clock.now = c.deadline
    assert c.step() == "extend"
    answer(c, "d1")
    assert c.step() == "answered"


def test_a_device_that_refuses_the_task_is_not_awaited_and_sits_the_round_out():
    roster = FixedRoster(["d0", "d1"])
    roster.refusals["d1"] = "paused by its owner"
    c, _, _ = collector(roster=roster)
    assert c.expected == {"d0"}
    answer(c, "d0")
    assert c.step() == "answered"
    assert sat_out(c).refused == {"d1": "paused by its owner"}


def test_a_device_that_takes_the_task_again_is_awaited_again_once_its_status_says_so():
    roster = FixedRoster(["d0", "d1"])
    roster.refusals["d1"] = "paused"
    c, _, _ = collector(roster=roster)
    answer(c, "d0")
    del roster.refusals["d1"]
    roster.set_online("d1", True)  # its new status
    c.look()
    assert c.expected == {"d0", "d1"} and c.step() == "wait"
    answer(c, "d1")
    assert c.step() == "answered" and sat_out(c).refused == {}


def test_refused_devices_leaving_too_few_takers_are_said_once_a_task(caplog):
    roster = FixedRoster(["d0", "d1"])
    roster.refusals["d1"] = "no such sensor"
    said: dict = {}
    clock = Clock()
    for _ in range(2):  # two rounds, the same devices: said in the first only
        c = RoundCollector(
            request(1, global_params()),
            CollectPolicy(deadline_s=10.0, min_participants=2, max_extensions=0),
            roster,
            clock=clock,
            said_short=said,
        )
        c.open()
        answer(c, "d0")
        with caplog.at_level(logging.WARNING, logger="cloud_aggregator.rounds.collector"):
            assert c.step() == "wait"  # everyone who takes it answered: said now, not at the deadline
            clock.now = c.deadline
            assert c.step() == "deadline"
    assert caplog.text.count("cannot reach [collect] min_participants = 2") == 1
    assert "d1 refuses it: no such sensor" in caplog.text


def test_a_held_out_device_online_keeps_the_round_open_until_it_scored_the_global():
    roster = FixedRoster(["d0", "h"])
    c, _, _ = collector(roster=roster, held_out=("h",))
    assert c.expected == {"d0"}  # it scores, it does not train
    answer(c, "d0")
    assert c.step() == "wait"
    roster.scores["h"] = {"accuracy": 0.9}
    assert c.step() == "answered"
    assert sat_out(c).holdout == {"h": {"accuracy": 0.9}}


def test_a_held_out_device_offline_is_not_waited_for():
    roster = FixedRoster(["d0", "h"])
    roster.set_online("h", False)
    c, _, _ = collector(roster=roster, held_out=("h",))
    answer(c, "d0")
    assert c.step() == "answered" and sat_out(c).holdout == {}


def test_without_a_fixed_list_a_device_coming_online_mid_round_is_awaited_and_one_leaving_is_not():
    roster = FixedRoster(["d0", "d1"])
    c, _, _ = collector(roster=roster)
    roster.set_online("d2", True)
    roster.set_online("d1", False)
    c.look()
    assert c.expected == {"d0", "d2"}


def test_a_fixed_list_is_kept_whatever_the_roster_says():
    roster = FixedRoster(["d0", "d1"])
    c, _, _ = collector(roster=roster, expected=("d0", "d1"))
    roster.set_online("d1", False)
    roster.set_online("d2", True)
    c.look()
    assert c.expected == {"d0", "d1"} and c.fixed


def test_the_server_choosing_participants_waits_for_those_only():
    roster, clock = FixedRoster(["d0", "d1", "d2"]), Clock()
    req = replace(request(1, global_params()), participants=("d1",))
    c = RoundCollector(req, CollectPolicy(deadline_s=10.0), roster, clock=clock)
    c.open()
    assert c.expected == {"d1"}
    answer(c, "d1")
    assert c.step() == "answered"


def test_a_refused_answer_is_filed_as_a_rejection_but_never_over_an_admitted_upload():
    c, _, _ = collector()
    c.file("d0", Refusal(Reason.NORM, "too far"))
    assert isinstance(c.inbox["d0"], Rejection) and "d0" not in c.inbox.answered
    answer(c, "d1")
    c.file("d1", Refusal(Reason.NORM, "a second copy, worse"))
    assert isinstance(c.inbox["d1"], Update) and c.inbox.answered == {"d1"}
    c.file("d0", Refusal(Reason.NOT_SELECTED, "held out", sat_out=True))  # sat out: only counted
    c.file("d0", Refusal(Reason.STALE_ROUND, "an old round"))  # not an answer to this round
    assert isinstance(c.inbox["d0"], Rejection) and "too far" in c.inbox["d0"].reason


def test_an_announcement_sets_the_deadline_and_says_when_it_moved():
    c, _, clock = collector()
    assert not c.announced(c.deadline)  # the same announcement again (a restatement)
    assert c.announced(clock.now + 60)  # an extension (a worker learns it from the announcement)
    clock.now += 30
    assert c.step() == "wait" and c.left() == 30

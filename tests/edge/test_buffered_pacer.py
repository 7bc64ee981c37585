"""The device's side of buffered rounds and a simulated pace (``edge.buffered.Pacer``), on a fake clock."""

from __future__ import annotations

from edge.buffered import Pacer
from edge.config import SimulateConfig
from ioft_protocol.round_messages import Announcement


class Device:
    """What the daemon gives the pacer: a clock, ``on_announcement``, its answered rounds, its status."""

    def __init__(self, sim: SimulateConfig) -> None:
        self.now = 0.0
        self.ran: list[tuple[str, int, str]] = []  # (task, round, global hash) trained and uploaded
        self.answered: dict[str, int] = {}
        self.presence: list[bool] = []
        self.declining = False  # the daemon declines (paused, no rows): nothing trained or answered
        self.declined = 0
        self.pacer = Pacer(
            "printer1", sim, self.run, self.answered.get, self.presence.append, lambda: self.now
        )

    def run(self, ann: Announcement) -> None:
        assert not self.pacer.hold(ann)  # the daemon's hook lets the pacer's own announcement through
        if self.declining:
            self.declined += 1
            return
        self.ran.append((ann.task, ann.round, ann.global_hash))
        self.answered[ann.task] = ann.round

    def at(self, t: float) -> None:
        self.now = t
        self.pacer.step()


def ann(version: int, mode: str = "buffered", state: str = "running") -> Announcement:
    return Announcement("f", "speed", version + 1, "train", "{}", 0.0, f"g{version}", state=state, mode=mode)


def test_a_buffered_device_trains_continuously_from_the_newest_global_with_rounds_of_its_own() -> None:
    dev = Device(SimulateConfig(update_s=1.0))
    assert dev.pacer.hold(ann(0))
    dev.at(0.5)
    assert dev.ran == []  # still computing
    dev.at(1.0)
    assert dev.ran == [("speed", 1, "g0")]
    dev.at(2.0)  # nothing new came: the same global again, under the next round
    assert dev.ran[-1] == ("speed", 2, "g0")
    for v in (1, 2, 3):  # three versions while it trains: only the newest is trained from
        dev.pacer.hold(ann(v))
    dev.at(3.0)
    assert dev.ran[-1] == ("speed", 3, "g0")  # the job started at 2.0, from what it had then
    dev.at(4.0)
    assert dev.ran[-1] == ("speed", 4, "g3")
    dev.pacer.hold(ann(9))
    dev.at(5.0)
    dev.at(6.0)
    assert dev.ran[-1] == ("speed", 10, "g9")  # at least the announcement's round (version + 1)
    assert not dev.pacer.hold(ann(9, state="done"))  # done: the daemon sees it, the pacer stops
    dev.at(100.0)
    assert dev.ran[-1] == ("speed", 10, "g9") and dev.pacer.next_at == float("inf")


def test_a_declined_job_starts_no_next_one_until_a_new_announcement() -> None:
    dev = Device(SimulateConfig())  # a real machine's pace: buffered jobs back to back
    dev.declining = True  # paused by its owner
    dev.pacer.hold(ann(0))
    dev.at(0.0)
    assert dev.declined == 1 and not dev.pacer.jobs and dev.pacer.next_at == float("inf")  # no spinning
    dev.declining = False  # resumed: the next announcement starts a job again
    dev.pacer.hold(ann(1))
    dev.at(0.0)
    assert dev.ran == [("speed", 2, "g1")] and dev.pacer.jobs  # and it goes on back to back


def test_a_synchronous_round_is_answered_once_after_the_simulated_time() -> None:
    assert not Device(SimulateConfig()).pacer.hold(ann(0, mode="sync"))  # not paced: answered at once
    dev = Device(SimulateConfig(update_s=2.0))
    assert dev.pacer.hold(ann(0, mode="sync"))
    dev.at(1.0)
    dev.pacer.hold(ann(0, mode="sync"))  # re-announced (a deadline extended): keeps its time
    dev.at(2.0)
    assert dev.ran == [("speed", 1, "g0")]
    dev.at(10.0)
    assert len(dev.ran) == 1  # a round is answered once


def test_churn_says_offline_loses_the_job_and_comes_back_to_the_newest() -> None:
    dev = Device(SimulateConfig(update_s=1.0, leave_per_s=0.5, away_s=1.0, seed=1))
    dev.pacer.hold(ann(0))
    t, left = 0.0, None
    while left is None:
        t += 0.05
        dev.at(t)
        if dev.presence == [False]:
            left = t
    assert not dev.pacer.jobs  # the update it was computing is lost
    ran = len(dev.ran)
    dev.pacer.hold(ann(5))  # a version that came while it was away
    while dev.presence == [False]:
        t += 0.05
        dev.at(t)
    assert dev.presence == [False, True] and len(dev.ran) == ran  # nothing was sent while away
    back = dev.pacer.jobs["speed"].ann
    assert back.global_hash == "g5"  # back, it trains from the newest it has

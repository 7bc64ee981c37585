"""A device answers one SecAgg session per (task, round, phase): a lying aggregator that opens a
second session for the same round (to difference two sums) gets nothing from it."""

from __future__ import annotations

import logging

import numpy as np

from edge.secagg_client import AnsweredSessions, SecAggDevice
from ioft_protocol.secagg import SecAggConfig
from ioft_protocol.secagg.messages import Setup
from ioft_protocol.secagg.transport import Envelope, SecAggTopic, parse_topic, topic_down

CFG = SecAggConfig(threshold=0.6)
NEIGHBOURS = ["d1", "d2", "d3"]


class Wire:
    def __init__(self) -> None:
        self.sent: list[Envelope] = []

    def __call__(self, topic: str, payload: bytes) -> None:
        self.sent.append(Envelope.decode(payload))


def setup(session: str, round_: int = 5) -> bytes:
    msg = Setup(session, CFG.round_params(4, 3).to_json(), NEIGHBOURS)
    return Envelope(session, round_, "train", "setup", msg.encode()).encode()


def topic() -> SecAggTopic:
    return parse_topic(topic_down("f", "speed", "d0"))


def test_a_second_session_for_the_same_round_is_refused_and_logged(caplog):
    wire = Wire()
    dev = SecAggDevice("f", "d0", wire)
    dev.arm("speed", 5, "train", np.ones(3), 1.0)
    dev.handle(topic(), setup("s1"))
    assert [e.session for e in wire.sent] == ["s1"]  # keys advertised for the first session
    with caplog.at_level(logging.WARNING, logger="edge.secagg_client"):
        dev.handle(topic(), setup("s2"))
    assert [e.session for e in wire.sent] == ["s1"]  # nothing for the second
    assert "refused SecAgg session s2, it answered session s1" in caplog.text
    # Re-arming the same round (a retrain) does not reset it: still one session.
    dev.arm("speed", 5, "train", np.ones(3), 1.0)
    dev.handle(topic(), setup("s3"))
    assert [e.session for e in wire.sent] == ["s1"]
    # The next round opens its own session.
    dev.arm("speed", 6, "train", np.ones(3), 1.0)
    dev.handle(topic(), setup("s4", round_=6))
    assert [e.session for e in wire.sent] == ["s1", "s4"]


def test_a_device_with_too_few_neighbours_advertises_nothing(caplog):
    wire = Wire()
    dev = SecAggDevice("f", "d0", wire)
    dev.arm("speed", 1, "train", np.ones(3), 1.0)
    alone = Setup("s1", CFG.round_params(1, 3).to_json(), [])
    with caplog.at_level(logging.WARNING, logger="edge.secagg_client"):
        dev.handle(topic(), Envelope("s1", 1, "train", "setup", alone.encode()).encode())
    assert wire.sent == [] and "fewer than its minimum of 3 participants" in caplog.text


def test_a_session_id_is_answered_once_even_after_a_restart(tmp_path, caplog):
    answered = tmp_path / "secagg-answered.json"
    wire = Wire()
    dev = SecAggDevice("f", "d0", wire, answered=answered)
    dev.arm("speed", 5, "train", np.ones(3), 1.0)
    dev.handle(topic(), setup("s1"))
    with caplog.at_level(logging.WARNING, logger="edge.secagg_client"):
        dev.handle(topic(), setup("s1"))  # the same session again: no second set of keys
    assert [e.session for e in wire.sent] == ["s1"]
    assert caplog.text.count("refused SecAgg session s1: it answered that session already") == 1
    # a restarted daemon (a new object on the same state) re-armed for that round: still refused
    again = SecAggDevice("f", "d0", wire, answered=answered)
    again.arm("speed", 5, "train", np.ones(3), 1.0)
    again.handle(topic(), setup("s1"))
    assert [e.session for e in wire.sent] == ["s1"]


def test_the_answered_sessions_are_bounded(tmp_path):
    answered = AnsweredSessions(tmp_path / "a.json", limit=3)
    for i in range(5):
        answered.add(f"s{i}")
    kept = AnsweredSessions(tmp_path / "a.json", limit=3)
    assert [s in kept for s in ("s0", "s1", "s2", "s3", "s4")] == [False, False, True, True, True]

"""MqttSession taps: a topic filter's messages handed over on the network thread, or passed on."""

from __future__ import annotations

from types import SimpleNamespace

from ioft_protocol.mqtt import MqttSession, topic_matches
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions


def test_topic_filters_match_as_mqtt_says():
    assert topic_matches("ioft/f/model/enc/3/chunk/+", "ioft/f/model/enc/3/chunk/12")
    assert not topic_matches("ioft/f/model/enc/3/chunk/+", "ioft/f/model/enc/4/chunk/12")
    assert not topic_matches("ioft/f/model/enc/3/chunk/+", "ioft/f/model/enc/3/chunk")
    assert not topic_matches("a/+", "a/b/c")
    assert topic_matches("a/#", "a/b/c") and topic_matches("a/b", "a/b") and not topic_matches("a/b", "a/c")


def test_a_filter_tap_takes_its_messages_unless_it_passes_them_on_to_the_queue():
    session = MqttSession(SessionOptions(BrokerAddress.parse("mqtt://127.0.0.1:1"), client_id="t"))
    taken = []
    session.tap("m/1/chunk/+", lambda msg: (taken.append(msg.topic), msg.topic != "m/1/chunk/9")[1])

    def arrive(topic: str) -> None:
        session._on_message(None, None, SimpleNamespace(topic=topic, payload=b"x", retain=True))

    for topic in ("m/1/chunk/0", "m/1/chunk/9", "m/2/chunk/0"):
        arrive(topic)
    assert taken == ["m/1/chunk/0", "m/1/chunk/9"]
    assert [session.get(0).topic for _ in range(2)] == ["m/1/chunk/9", "m/2/chunk/0"]  # passed on; no tap
    session.tap("m/1/chunk/+", None)
    arrive("m/1/chunk/1")
    assert session.get(0).topic == "m/1/chunk/1" and taken == ["m/1/chunk/0", "m/1/chunk/9"]


def test_a_topic_is_matched_against_the_filters_once_until_the_taps_change(monkeypatch):
    """Every upload used to build a paho matcher per tapped filter (~4 µs on the network thread)."""
    import ioft_protocol.mqtt as mqtt

    session = MqttSession(SessionOptions(BrokerAddress.parse("mqtt://127.0.0.1:1"), client_id="t"))
    matched = []
    monkeypatch.setattr(
        mqtt, "topic_matches", lambda f, t: matched.append(t) or mqtt.paho.topic_matches_sub(f, t)
    )
    taken = []
    session.tap("f/+/status", taken.append)

    def arrive(topic: str) -> None:
        session._on_message(None, None, SimpleNamespace(topic=topic, payload=b"x", retain=False))

    for _ in range(3):
        arrive("f/task/t/up/d1")
        arrive("f/d1/status")
    assert matched == ["f/task/t/up/d1", "f/d1/status"]  # once per topic
    assert [m.topic for m in taken] == ["f/d1/status"] * 3 and session.inbound.qsize() == 3
    session.tap("f/+/up", taken.append)  # a new tap: topics are matched afresh
    session.tap("f/+/status", None)
    arrive("f/d1/status")
    assert session.inbound.qsize() == 4 and len(taken) == 3

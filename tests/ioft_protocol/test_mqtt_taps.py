"""MqttSession taps: a topic filter's messages handed over on the network thread, or passed on."""

from __future__ import annotations

from types import SimpleNamespace

from ioft_protocol.mqtt import BrokerAddress, MqttSession, SessionOptions, topic_matches


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

"""ioft_protocol.restate: the rules by which retained state also travels live (no broker here;
tests/e2e/test_rabbitmq_cluster.py runs them on a real two-node RabbitMQ cluster)."""

from __future__ import annotations

from ioft_protocol import restate, topics


def test_roll_call_topic_parses():
    assert topics.parse_topic(topics.topic_roll_call("plant-7")) == topics.Topic("roll_call", "plant-7")


def test_a_connection_is_new_when_online_from_a_stamp_not_seen():
    first = restate.connection({"state": "online", restate.CONNECTED_AT: 100.0})
    again = restate.connection({"state": "online", restate.CONNECTED_AT: 100.0, "tasks": {"t": {"round": 3}}})
    later = restate.connection({"state": "online", restate.CONNECTED_AT: 250.0})
    assert first is not None and first == again  # a status re-stated or after a round: same connection
    assert later != first  # reconnected
    assert restate.connection({"state": "offline", restate.CONNECTED_AT: 100.0}) is None
    # An older device without the stamp: one value while online, so new only after being offline.
    assert restate.connection({"state": "online"}) == restate.connection({"state": "online"})


def test_restatement_prefers_the_devices_own_downlink():
    broadcast = (topics.topic_down("f", "t"), b"all")
    own = (topics.topic_down_device("f", "t", "d1"), b"mine")
    assert restate.restatement("f", "t", "d1", [broadcast, own]) == own
    assert restate.restatement("f", "t", "d2", [broadcast, own]) == (
        topics.topic_down_device("f", "t", "d2"),
        b"all",
    )
    assert restate.restatement("f", "t", "d1", []) is None


def test_a_restated_copy_is_dropped_only_on_the_connection_that_brought_the_announcement():
    seen = restate.Delivered()
    seen.connected()
    assert not seen.duplicate("down", b"round 1")  # the retained broadcast (mosquitto)
    assert seen.duplicate("down_device", b"round 1")  # the aggregator's copy: already handled
    assert not seen.duplicate("down", b"round 1")  # re-announced on the broadcast (a restart): answered
    assert not seen.duplicate("down_device", b"round 2")  # a copy of what this connection never brought
    seen.connected()  # reconnected: the copy is the only way the round arrives
    assert not seen.duplicate("down_device", b"round 1")


def test_delivered_remembers_a_bounded_number_of_announcements():
    seen = restate.Delivered()
    for i in range(1000):
        seen.duplicate("down", b"%d" % i)
    assert seen.duplicate("down_device", b"999")
    assert not seen.duplicate("down_device", b"0")


def test_devices_of_a_swarm_share_the_hash_not_the_memory():
    """A swarm's devices hash an announcement once between them (``Delivered._last``); what each
    handled on its connection stays its own."""
    a, b = restate.Delivered(), restate.Delivered()
    a.connected(), b.connected()
    assert not a.duplicate("down", b"round 7")
    assert not b.duplicate("down_device", b"round 7")  # b never got the broadcast: answered
    assert b.duplicate("down_device", b"round 7")  # now it has
    assert a.duplicate("down_device", bytearray(b"round 7"))  # any bytes-like payload
    assert not a.duplicate("down_device", b"round 8")

"""ioft_protocol.outbox: what a session publishes waits, bounded, while it is not connected; a
newer retained message replaces a waiting one; paho is handed at most ``in_flight`` unacked."""

from __future__ import annotations

from ioft_protocol.outbox import Outbox


class FakeClient:
    """Records what the outbox hands over; acks only when told."""

    def __init__(self) -> None:
        self.connected = False
        self.sent: list[tuple[str, bytes, int]] = []
        self.mid = 0
        self.ack_at_once = False
        self.outbox: Outbox | None = None

    def send(self, topic: str, payload: bytes, qos: int, retain: bool) -> tuple[int, bool]:
        self.mid += 1
        self.sent.append((topic, payload, self.mid))
        if self.ack_at_once:  # the ack races the mid's registration (network thread)
            self.outbox.acked(self.mid)
        return self.mid, True


def outbox(limit: int = 10, in_flight: int = 3) -> tuple[Outbox, FakeClient]:
    client = FakeClient()
    box = Outbox(client.send, lambda: client.connected, limit, in_flight)
    client.outbox = box
    return box, client


def test_messages_wait_while_disconnected_and_go_out_in_order_on_connect():
    box, client = outbox()
    box.put("a", b"1", 1, False, False)
    box.put("b", b"2", 1, False, False)
    assert client.sent == [] and len(box) == 2
    client.connected = True
    box.pump()
    assert [t for t, _, _ in client.sent] == ["a", "b"] and len(box) == 0


def test_a_newer_message_replaces_a_waiting_one_on_its_topic_and_the_old_ticket_is_dropped():
    box, client = outbox()
    old = box.put("state", b"v1", 1, True, True)
    box.put("other", b"x", 1, False, False)
    new = box.put("state", b"v2", 1, True, True)
    assert old.dropped and not old.wait(0)
    client.connected = True
    box.pump()
    assert [(t, p) for t, p, _ in client.sent] == [("other", b"x"), ("state", b"v2")]
    box.acked(client.sent[1][2])
    assert new.wait(0)


def test_overflow_drops_the_oldest_and_never_raises():
    box, _ = outbox(limit=3)
    tickets = [box.put(f"t{i}", b"", 1, False, False) for i in range(5)]
    assert len(box) == 3
    assert [t.dropped for t in tickets] == [True, True, False, False, False]
    assert box.overflowed == 2


def test_at_most_in_flight_unacked_and_an_ack_makes_room():
    box, client = outbox(in_flight=2)
    client.connected = True
    for i in range(4):
        box.put(f"t{i}", b"", 1, False, False)
    assert len(client.sent) == 2 and box.unacked == 2 and len(box) == 2
    box.acked(client.sent[0][2])
    assert len(client.sent) == 3 and box.unacked == 2


def test_an_ack_that_comes_before_the_mid_is_known_still_completes_the_ticket():
    box, client = outbox()
    client.connected = True
    client.ack_at_once = True
    ticket = box.put("t", b"", 1, False, False)
    assert ticket.wait(0) and box.unacked == 0

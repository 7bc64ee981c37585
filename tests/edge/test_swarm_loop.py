"""edge.swarm.SwarmLoop against a real mosquitto: what paho queues is written before the next
select, a message larger than the socket's buffer goes out through the selector, and sessions
reconnect after a broker restart and publish again."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from cloud_aggregator.local.broker import start_mosquitto
from edge.swarm import SwarmLoop, SwarmSession
from ioft_protocol.mqtt import BrokerAddress, SessionOptions


def drive(loop: SwarmLoop, done: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Poll the loop until ``done()``; fail naming ``what`` if it never comes (no timing asserted)."""
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        loop.poll(0.05)


def received(session: SwarmSession) -> list[bytes]:
    out = []
    while not session.inbound.empty():
        out.append(session.inbound.get_nowait().payload)
    return out


@pytest.mark.broker
def test_swarm_loop_writes_large_and_small_messages_and_reconnects(mosquitto, tmp_path):
    loop = SwarmLoop()
    address = BrokerAddress.parse(mosquitto.url)
    options = dict(keepalive=60, reconnect_min_s=0.2, reconnect_max_s=0.5)
    sender = SwarmSession(SessionOptions(address, "loop-sender", **options), loop)
    receiver = SwarmSession(SessionOptions(address, "loop-receiver", **options), loop)
    receiver.subscribe("t/data")
    subacks: list[object] = []  # the broker routes to the receiver once it has sent the SUBACK
    receiver.client.on_subscribe = lambda *args: subacks.append(args)
    for s in (sender, receiver):
        s.start()
    drive(loop, lambda: sender.connected.is_set() and receiver.connected.is_set(), "both connected")
    drive(loop, lambda: len(subacks) >= 1, "the receiver's SUBACK")

    # 8 MB does not fit a socket's send buffer: paho writes part, the selector waits for room.
    big = bytes(range(256)) * (8 * 4096)
    small = [f"small {i}".encode() for i in range(20)]
    tickets = [sender.publish("t/data", big, timeout=None)]
    tickets += [sender.publish("t/data", m, timeout=None) for m in small]
    got: list[bytes] = []
    drive(loop, lambda: got.extend(received(receiver)) or len(got) >= 21, "21 messages delivered")
    assert got == [big, *small]  # whole and in order
    drive(loop, lambda: all(t.done.is_set() for t in tickets), "every publish acked")
    assert not any(t.dropped for t in tickets)

    # The broker restarts on the same port: both sessions reconnect (re-subscribing) and go on.
    port = mosquitto.port
    mosquitto.stop()
    # Written into the dead connection: the write fails, paho closes the socket under the loop.
    for i in range(3):  # the first write may still go out; the next find the connection reset
        sender.publish("t/data", f"while down {i}".encode(), timeout=None)
    drive(loop, lambda: not sender.connected.is_set() and not receiver.connected.is_set(), "both dropped")
    before = len(subacks)
    mosquitto.proc = start_mosquitto(port, log_file=tmp_path / "mosquitto2.log").proc
    drive(loop, lambda: sender.connected.is_set() and receiver.connected.is_set(), "both reconnected")
    drive(loop, lambda: len(subacks) > before, "the receiver's SUBACK after it re-subscribed")
    after = sender.publish("t/data", b"after the restart", timeout=None)
    got = []
    drive(
        loop,
        lambda: got.extend(received(receiver)) or b"after the restart" in got,
        "a message after the restart",
    )
    # paho re-sends the QoS 1 message the dead connection lost; the receiver sees it if it was back first.
    assert got[-1] == b"after the restart" and all(m.startswith(b"while down") for m in got[:-1]), got
    drive(loop, after.done.is_set, "the publish after the restart acked")
    for s in (sender, receiver):
        s.stop()
    drive(loop, lambda: sender.client.socket() is None and receiver.client.socket() is None, "both closed")

"""ioft_protocol.service.Notifier against a real unix datagram socket (systemd's side of sd_notify)."""

from __future__ import annotations

import os
import socket

from ioft_protocol.service import Notifier
from tests.e2e.notify import NotifyListener


def test_without_notify_socket_every_call_is_a_no_op():
    n = Notifier.from_env({})
    n.ready("up")
    n.alive()
    n.stopping()
    assert not n.enabled and n.watchdog_s is None


def test_ready_pings_and_stopping_arrive_in_order_on_the_socket():
    # Prepare
    listener = NotifyListener()
    n = Notifier.from_env(listener.env(watchdog_s=0.03))
    try:
        # Execute: a loop before and after READY, then STOPPING
        n.alive()
        n.ready("connected")
        for _ in range(3):
            n._next_ping = 0.0  # the next turn is due (the rate limit is a third of the watchdog)
            n.alive()
        n.stopping("bye")
        listener.drain(0.2)
    finally:
        n.close()
        listener.close()

    # Assert
    assert listener.messages == [
        ["EXTEND_TIMEOUT_USEC=60000"],
        ["READY=1", "STATUS=connected"],
        ["WATCHDOG=1"],
        ["WATCHDOG=1"],
        ["WATCHDOG=1"],
        ["STOPPING=1", "STATUS=bye"],
    ]


def test_pings_are_rate_limited_to_a_third_of_the_watchdog():
    listener = NotifyListener()
    n = Notifier.from_env(listener.env(watchdog_s=3600))
    try:
        n.ready()
        for _ in range(1000):
            n.alive()
        listener.drain(0.1)
    finally:
        n.close()
        listener.close()
    assert listener.messages == [["READY=1"]]


def test_a_path_socket_and_a_watchdog_meant_for_another_process(tmp_path):
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(1.0)
    env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    n = Notifier.from_env(env)
    try:
        assert n.watchdog_s is None  # WATCHDOG_PID names another process: not ours to ping
        n.ready()
        assert sock.recv(100) == b"READY=1"
    finally:
        n.close()
        sock.close()


def test_nobody_listening_is_not_an_error(tmp_path):
    n = Notifier(str(tmp_path / "gone"), watchdog_s=1.0)
    n.ready()
    assert n.notify("STATUS=x") is False
    n.close()


def test_a_full_socket_never_blocks_the_loop(tmp_path):
    # Prepare: systemd's end bound but never read (its queue fills after a few datagrams)
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    n = Notifier(str(path), watchdog_s=1.0)
    try:
        # Execute: far more pings than the queue holds
        sent = [n.notify("WATCHDOG=1", wait=False) for _ in range(1000)]
    finally:
        n.close()
        sock.close()
    # Assert: the first went, the rest were dropped (not waited for)
    assert sent[0] and not sent[-1]

"""A swarm's devices connect and reconnect with full jitter (``edge.swarm.SwarmSession.backoff``):
uniform(0, min(cap, base · 2^n)).  Without it a broker restart brings every device back in one
instant, again and again while the broker refuses them.  Asserted on draws, on how many devices
connect in one turn of the loop, and on the broker's own log; never on wall-clock times."""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Callable

import pytest

from cloud_aggregator.local.broker import start_mosquitto
from edge.swarm import SwarmLoop, SwarmSession
from ioft_protocol.mqtt import BrokerAddress, SessionOptions

N = 200


def session(loop: SwarmLoop, name: str, url: str = "mqtt://127.0.0.1:1", **options) -> SwarmSession:
    return SwarmSession(SessionOptions(BrokerAddress.parse(url), name, keepalive=60, **options), loop)


def test_backoff_draws_from_the_whole_window_which_doubles_to_its_cap_and_resets_on_connack():
    loop = SwarmLoop(random.Random(7))
    s = session(loop, "jitter", reconnect_min_s=0.5, reconnect_max_s=4.0)
    windows = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]  # min · 2^n, capped
    draws = {w: [] for w in windows}
    for _ in range(300):
        s.jitter.reset()  # the broker accepted it (CONNACK): the next loss starts from the base again
        for w in windows:
            draws[w].append(s.backoff())
    for w, got in draws.items():
        assert all(0.0 <= d <= w for d in got)
        # full jitter: the draws cover the window, from near 0 to near its top
        assert min(got) < 0.1 * w and max(got) > 0.9 * w
    assert len(set(draws[0.5])) == 300  # not one delay shared by all


def test_backoff_waits_at_least_a_takeovers_wait():
    loop = SwarmLoop(random.Random(1))
    s = session(loop, "jitter", reconnect_min_s=0.5, reconnect_max_s=4.0)
    s.takeover_wait_s = 30.0
    assert s.backoff() == 30.0


def drive(loop: SwarmLoop, done: Callable[[], bool], what: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        loop.poll(0.05)


def connects_in_log(path) -> Counter:
    """How many times mosquitto logged each client id's connect."""
    return Counter(re.findall(r"New client connected from \S+ as (\S+) ", path.read_text(errors="replace")))


@pytest.mark.broker
def test_200_swarm_devices_come_back_after_a_broker_restart_spread_over_the_loops_turns(mosquitto, tmp_path):
    loop = SwarmLoop()
    sessions = [
        session(loop, f"jitter-{i:03d}", mosquitto.url, reconnect_min_s=1.0, reconnect_max_s=4.0)
        for i in range(N)
    ]
    # Which turn of the loop (poll) each connect attempt came in.
    turn = [0]
    attempts: list[int] = []
    poll = loop.poll

    def counted(timeout: float):
        turn[0] += 1
        return poll(timeout)

    loop.poll = counted  # type: ignore[method-assign]
    for s in sessions:
        connect = s.connect

        def recorded(connect=connect) -> None:
            attempts.append(turn[0])
            connect()

        s.connect = recorded  # type: ignore[method-assign]
        s.start()
    everyone = lambda: all(s.connected.is_set() for s in sessions)  # noqa: E731
    drive(loop, everyone, f"all {N} connected")
    first = Counter(attempts)
    # Started together, they knock in many turns, no turn with half of them.
    assert len(first) >= 4 and max(first.values()) < N // 2, first

    # The broker goes away: every device drops at once; each draws its own delay from the window
    # (1 s, then 2 s, 4 s while the broker refuses them), none the same as its neighbours'.
    delays: dict[int, list[float]] = {}
    closed = loop.closed

    def drawn(s: SwarmSession) -> None:
        n = s.jitter.failures
        closed(s)
        if s in loop._reconnect:  # (not when it stops)
            delays.setdefault(n, []).append(loop._reconnect[s] - time.monotonic())

    loop.closed = drawn  # type: ignore[method-assign]
    port = mosquitto.port
    mosquitto.stop()
    drive(loop, lambda: not any(s.connected.is_set() for s in sessions), "all dropped")
    drive(loop, lambda: len(delays.get(1, [])) >= N, "every device refused once")  # the broker is down
    for n, got in delays.items():
        window = min(4.0, 1.0 * 2**n)
        assert all(d <= window for d in got), (n, max(got))
        if len(got) >= N // 2:  # full jitter: spread over the whole window, not one shared delay
            assert min(got) < 0.25 * window and max(got) > 0.75 * window, (n, min(got), max(got))
    attempts.clear()
    log = tmp_path / "mosquitto-restarted.log"
    mosquitto.proc = start_mosquitto(port, log_file=log).proc
    drive(loop, everyone, f"all {N} back")
    again = Counter(attempts)
    assert len(again) >= 4 and max(again.values()) < N // 2, again
    # The restarted broker saw each device connect once: no storm of repeated connects.
    loop.poll(0.05)
    seen = connects_in_log(log)
    assert sorted(seen) == sorted(s.options.client_id for s in sessions)
    assert set(seen.values()) == {1}, seen.most_common(3)
    for s in sessions:
        s.stop()
    drive(loop, lambda: all(s.client.socket() is None for s in sessions), "all closed")

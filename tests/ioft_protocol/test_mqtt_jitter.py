"""The daemon's session reconnects with full jitter (``ioft_protocol.backoff``, the draw the swarm's
sessions share): uniform(0, min(cap, base · 2^n)), reset on CONNACK, never under a takeover's wait.
Its first connect is immediate; every later one, the first after a lost connection included, is
drawn.  Asserted on seeded draws, on the order of the background thread's steps, and on a real
mosquitto's restart under 20 sessions (their reconnects spread relative to each other); never on
wall-clock targets."""

from __future__ import annotations

import random
import threading
import time

import paho.mqtt.client as paho
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from cloud_aggregator.local.broker import start_mosquitto
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_loop import SocketLoop
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions

#: Guards against a hung test only; nothing here is a timing assertion.
PATIENCE_S = 60.0
ACCEPTED = ReasonCode(PacketTypes.CONNACK, identifier=0)


def session(url: str, client_id: str, rng: random.Random | None = None, **options) -> MqttSession:
    return MqttSession(SessionOptions(BrokerAddress.parse(url), client_id, **options), rng)


def seeded(seed: int) -> MqttSession:
    """A session (never started) whose delays a seeded rng draws: windows 0.5, 1, 2, 4 s (the cap)."""
    return session(
        "mqtt://127.0.0.1:1", "jitter", random.Random(seed), reconnect_min_s=0.5, reconnect_max_s=4.0
    )


def accept(s: MqttSession) -> None:
    """The broker's CONNACK, as paho hands it to the session (no socket: nothing to send)."""
    s._on_pre_connect(s._client, None)
    s._on_connect(s._client, None, {}, ACCEPTED, None)


def until(condition, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def test_delays_cover_a_window_that_doubles_to_its_cap_and_resets_on_connack():
    s = seeded(3)
    windows = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]  # min · 2^n, capped
    draws: dict[float, list[float]] = {w: [] for w in windows}
    rounds = []
    for _ in range(300):
        accept(s)  # the next loss starts from the base again
        rounds.append([s.backoff() for _ in windows])
        for w, d in zip(windows, rounds[-1], strict=True):
            draws[w].append(d)
    for w, got in draws.items():
        assert all(0.0 <= d <= w for d in got)
        # full jitter: the draws cover the window, from near 0 to near its top
        assert min(got) < 0.1 * w and max(got) > 0.9 * w
    assert len(set(draws[0.5])) == 300  # not one delay shared by all
    # A seeded session draws the same delays again.
    again = seeded(3)
    assert [again.backoff() for _ in windows] == rounds[0]


def test_a_takeover_is_the_floor_of_the_draws():
    s = seeded(1)
    # The broker closes the connection right after accepting it, takeover_limit (3) times in a row.
    for _ in range(3):
        accept(s)
        s._count_drop(s._client, True, 0.1)
    assert s.takeover_wait_s == 5.0
    assert [s.backoff() for _ in range(50)] == [5.0] * 50  # the windows (≤ 4 s) stay under it
    s.options = SessionOptions(s.options.broker, "jitter", reconnect_min_s=8.0, reconnect_max_s=20.0)
    got = [s.backoff() for _ in range(200)]
    assert min(got) == 5.0 and max(got) > 5.0  # a draw above the floor stays as drawn
    s._back_off(None)  # the takeovers ended: the draws alone
    assert min(s.backoff() for _ in range(200)) < 5.0


class Refused(paho.Client):
    """A client whose every connect fails at once, noting the order of attempts and waits."""

    def __init__(self, steps: list[str]) -> None:
        super().__init__(paho.CallbackAPIVersion.VERSION2, client_id="refused")
        self.steps = steps

    def reconnect(self):
        self.steps.append("connect")
        raise ConnectionRefusedError


def test_the_first_connect_is_at_once_and_every_later_one_waits_a_drawn_delay():
    steps: list[str] = []
    done = threading.Event()

    def backoff() -> float:
        steps.append("wait")
        if steps.count("connect") >= 4:
            done.set()
        return 0.0

    loop = SocketLoop(Refused(steps), lambda: None, done.is_set, backoff)
    loop.start("refused")
    assert done.wait(PATIENCE_S)
    loop.stop()
    assert steps[:8] == ["connect", "wait"] * 4


@pytest.mark.broker
def test_20_sessions_come_back_after_a_broker_restart_spread_out_and_subscribed(mosquitto, tmp_path):
    n, topic = 20, "jitter/all"
    sessions = [
        session(mosquitto.url, f"jitter-{i:02d}", random.Random(i), reconnect_min_s=1.0, reconnect_max_s=4.0)
        for i in range(n)
    ]
    connects: list[list[float]] = [[] for _ in sessions]  # monotonic time of each CONNACK, per session
    for s, times in zip(sessions, connects, strict=True):
        s.on_connect_hooks.append(lambda times=times: times.append(time.monotonic()))
        s.subscribe(topic)
        s.start(None)
    back = publisher = None
    try:
        until(lambda: all(s.connected.is_set() for s in sessions), f"all {n} connected")
        mosquitto.kill()
        until(lambda: not any(s.connected.is_set() for s in sessions), "all to see the drop")
        back = start_mosquitto(mosquitto.port, log_file=tmp_path / "mosquitto2.log")
        until(lambda: all(len(times) >= 2 for times in connects), f"all {n} back")
        # Spread relative to each other: with no jitter every session retries after the same
        # wait, all within a few ms; drawn from [0, 1 s] (then [0, 2 s] while refused), no tenth
        # of a second holds half of them.
        again = sorted(times[-1] for times in connects)
        crowd = max(sum(1 for t in again if t0 <= t < t0 + 0.1) for t0 in again)
        assert crowd < n // 2, [round(t - again[0], 3) for t in again]
        # Each came back with its subscription: the restarted broker knew none of them.
        publisher = session(back.url, "jitter-publisher")
        publisher.start()
        publisher.publish(topic, b"back", retain=True, timeout=PATIENCE_S)
        for s in sessions:
            msg = s.get(PATIENCE_S)
            assert msg is not None and msg.payload == b"back", s.options.client_id
    finally:
        for s in [*sessions, publisher]:
            if s is not None:
                s.stop()
        if back is not None:
            back.stop()

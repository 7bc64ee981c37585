"""Reconnect delays with AWS's "full jitter", for the daemon's session and the swarm's alike.

Each delay is drawn from uniform(0, min(cap, base · 2^n)), n the connections ended since the
broker last accepted one (:meth:`FullJitter.reset` on each CONNACK).  Without the draw a broker's
restart brings every client of a fleet back in the same instant, and again at each refusal;
drawn from the whole window, the attempts spread evenly over it.  ``ioft_protocol.mqtt.MqttSession.backoff`` asks for the delays; its
network thread (``mqtt_loop.SocketLoop``) and ``edge.swarm.SwarmLoop`` wait them out.
"""

from __future__ import annotations

import random

#: Doublings at most: the window reaches any sane cap long before, and 2^n stays a small float.
MAX_DOUBLINGS = 10


class FullJitter:
    """The draws of one session (or of many, sharing ``rng``): a test passes a seeded ``rng``."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()
        #: Delays drawn since the broker last accepted a connection.
        self.failures = 0

    def reset(self) -> None:
        """The broker accepted a connection: the next loss starts from ``base`` again."""
        self.failures = 0

    def draw(self, base: float, cap: float, floor: float = 0.0) -> float:
        """Seconds to wait before the next attempt, at least ``floor`` (another client holds our
        identity: the takeover's wait, which the draw must not shorten)."""
        window = min(cap, base * 2 ** min(self.failures, MAX_DOUBLINGS))
        self.failures += 1
        return max(self.rng.uniform(0.0, window), floor)

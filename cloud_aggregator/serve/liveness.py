"""Which devices that say "online" are live: rounds wait only for those.

A device's status is retained, so the broker hands the last one to every new subscriber.  A
device that crashes is covered by its Last Will ("offline"), but a retained "online" with no
will behind it -- a client that published one by hand, a device whose will was lost with a
broker's store, an impostor -- says "online" for ever, and every round that waits for
"whoever is online" would wait out its deadline for it.

So a retained status proves nothing about now.  What does is a status the device published
while this aggregator listened: MQTT 3.1.1 delivers a message that matches an established
subscription with the retain flag cleared, and only one retained per topic at subscribe time.
Every live device sends one at once when the aggregator calls the roll (each connect), and again
at least every ``heartbeat_s`` (``device.toml``, default 30 s) while connected.  A device counts as
live for ``liveness_s`` (``[collect]``, default 90 s: three missed heartbeats) after the last
one; ``0`` trusts every "online" status, retained or live.  A round that starts with devices not live
names them and calls the roll (at most once a ``liveness_s``): one that answers joins the round,
so a device too old for a heartbeat loses nothing, and a ghost costs one roll call that often.
A device awaited stays awaited while it says online, its heartbeat late or not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Liveness:
    """When each device was last heard live, and for how long that counts (``window_s``; 0: off)."""

    window_s: float = 0.0
    #: device -> monotonic time of its last live "online" status
    heard: dict[str, float] = field(default_factory=dict)

    def note(self, device: str, online: bool, live: bool) -> None:
        """A status from ``device``: ``live`` when it was published while we listened (not retained)."""
        if not online:
            self.heard.pop(device, None)  # a retained "online" after this proves nothing again
        elif live:
            self.heard[device] = time.monotonic()

    def is_live(self, device: str) -> bool:
        """Whether ``device`` (online) was heard live within the window (always, with the window off)."""
        return self.window_s <= 0 or self.heard.get(device, -1.0) >= time.monotonic() - self.window_s

    def live(self, online: list[str]) -> list[str]:
        """Those of ``online`` heard live within the window (all of them with the window off)."""
        if self.window_s <= 0:
            return online
        since, heard = time.monotonic() - self.window_s, self.heard
        return [d for d in online if heard.get(d, -1.0) >= since]

    def unconfirmed(self, online: list[str]) -> dict[str, str]:
        """Those of ``online`` not live, each with why (for the round's record and the log)."""
        if self.window_s <= 0:
            return {}
        now, heard = time.monotonic(), self.heard
        out = {}
        for d in online:
            at = heard.get(d)
            if at is None:
                out[d] = (
                    "says online only in a retained status: not heard live since this aggregator connected"
                )
            elif now - at > self.window_s:
                out[d] = f"not heard for {now - at:.0f} s (liveness_s = {self.window_s:g})"
        return out

"""When the device's retained status is due: after answered rounds (at most every
``round_status_s``), as a heartbeat (``heartbeat_s`` without one while connected), and once when
no aggregator of its fleet has answered within ``aggregator_quiet_s`` of its first connection.

The clock only says when; :class:`edge.daemon.EdgeTrainer` builds and publishes the status.
"""

from __future__ import annotations

import time


class StatusClock:
    """One device's status timing, on the monotonic clock."""

    def __init__(self, round_status_s: float, heartbeat_s: float, aggregator_quiet_s: float) -> None:
        self.round_status_s = round_status_s
        self.heartbeat_s = heartbeat_s
        self.aggregator_quiet_s = aggregator_quiet_s
        #: the last retained status published, and the one published at the last connect
        self.sent_at = self.born_at = float("-inf")
        self.due = False  # a newer status waits for round_status_s to pass
        #: the first connection, until the fleet's aggregator is first heard from
        self.unheard_since: float | None = None
        self.heard_once = False

    def born(self) -> None:
        """A connection began: the status it publishes counts as the heartbeat's too."""
        self.born_at = time.monotonic()
        if self.unheard_since is None and not self.heard_once:
            self.unheard_since = self.born_at

    def sent(self) -> None:
        """A status went out: nothing waits."""
        self.sent_at, self.due = time.monotonic(), False

    def round_answered(self) -> bool:
        """A round was answered: ``True`` if its status goes out now, else it waits (:meth:`rounds_due`)
        -- a fleet of 10,000 answering a round a second would otherwise publish, and the aggregator
        parse, 10,000 statuses a second."""
        if time.monotonic() - self.sent_at >= self.round_status_s:
            return True
        self.due = True
        return False

    def rounds_due(self) -> bool:
        """Whether the rounds answered since the last status may show now."""
        return self.due and time.monotonic() - self.sent_at >= self.round_status_s

    def heartbeat_due(self, connected: bool) -> bool:
        """Connected, and no status went out for ``heartbeat_s``: the next one is the heartbeat."""
        return (
            self.heartbeat_s > 0
            and connected
            and time.monotonic() - max(self.sent_at, self.born_at) >= self.heartbeat_s
        )

    def quiet_too_long(self) -> bool:
        """Whether ``aggregator_quiet_s`` passed since the first connection with no aggregator heard."""
        since = self.unheard_since
        return since is not None and time.monotonic() - since >= self.aggregator_quiet_s

    def heard(self) -> bool:
        """The fleet's aggregator answered: ``True`` the first time."""
        if self.heard_once:
            return False
        self.heard_once, self.unheard_since = True, None
        return True

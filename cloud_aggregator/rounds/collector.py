"""One round's waiting, apart from any transport: whom it awaits, until when, and when it closes.

A :class:`RoundCollector` owns what a round received (its :class:`Inbox`), whom it expects,
who refused the task, what held-out devices scored, its deadline and extensions, and the
closing rule.  Its inputs are the verdicts filed into it (admission's, or a worker's batch),
the roster of devices (their statuses, read through :class:`Roster`) and a clock passed in,
so it is driven the same way over MQTT (``cloud_aggregator.serve.mqtt_fleet``), by an
aggregator worker (``cloud_aggregator.serve.worker_loop``) and in tests, without sleeping.

The closing rule: a round closes ``"answered"`` once every awaited device has an admitted
upload, at least ``min_participants`` of them, and every held-out device online and live has
scored the round's global; otherwise at the deadline (``"deadline"``).  With fewer than
``min_participants`` valid uploads by then the deadline is extended, up to ``max_extensions``
times, after which the round engine abandons the round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.inbox import Inbox, file_verdict
from cloud_aggregator.rounds.types import CollectRequest, LateUpdate, Refusal, Rejection, SatOut
from ioft_protocol import codec
from ioft_protocol.round_messages import DeviceSelection

log = logging.getLogger(__name__)

#: Devices named in one "waiting for" log line; the rest are counted.
NAMED = 20


@dataclass
class CollectPolicy:
    """How long to wait and for whom.

    ``expected`` lists the devices a round waits for; empty means "whoever is
    online", which a device joins by coming online and leaves by going offline
    mid-round.  A round ends when all expected devices answered with at least
    ``min_participants`` valid uploads, or when ``deadline_s`` passed; with fewer
    than ``min_participants`` valid uploads by then the deadline is extended (and
    the round re-announced) up to ``max_extensions`` times, after which the round
    engine abandons it.  Before the first round the fleet waits up to
    ``startup_wait_s`` for ``min_participants`` (or all expected) devices to come online.
    """

    deadline_s: float = 30.0
    min_participants: int = 1
    max_extensions: int = 2
    expected: tuple[str, ...] = ()
    startup_wait_s: float = 60.0
    max_payload_bytes: int = codec.MAX_PAYLOAD_BYTES
    #: A streaming round (``cloud_aggregator.aggregation.streaming``) checkpoints its partial sum after this
    #: many admitted uploads and drops their stored payloads: a restart resumes from the
    #: checkpoint plus at most this many stored uploads.
    checkpoint_every: int = 256
    #: Without ``expected``, rounds wait only for devices heard live (a status sent while this
    #: aggregator listened) within this many seconds, and name the others (:mod:`.liveness`); 0: off.
    liveness_s: float = 0.0


class Liveness(Protocol):
    """Which devices that say online were heard live lately (``cloud_aggregator.serve.liveness``)."""

    def is_live(self, device: str) -> bool: ...

    def live(self, online: list[str]) -> list[str]: ...

    def unconfirmed(self, online: list[str]) -> dict[str, str]: ...


class Roster(Protocol):
    """What a round reads of the devices (``cloud_aggregator.serve.mqtt_fleet.DeviceRoster``)."""

    online: Mapping[str, bool]
    liveness: Liveness
    #: statuses taken in so far: a round re-reads the O(N) view only when this moved
    changes: int

    def online_devices(self) -> list[str]: ...

    def live_devices(self) -> list[str]: ...

    def refusal(self, device: str, task: str, selection: DeviceSelection | None) -> str | None: ...

    def holdout_score(self, device: str, task: str, request: CollectRequest) -> dict[str, float] | None: ...

    def ahead(self, task: str, round_: int) -> dict[str, int]: ...


class _AllLive:
    """Liveness off: every device that says online is live."""

    def is_live(self, device: str) -> bool:
        return True

    def live(self, online: list[str]) -> list[str]:
        return online

    def unconfirmed(self, online: list[str]) -> dict[str, str]:
        return {}


class FixedRoster:
    """A roster without statuses: ``devices`` online and live, none refusing a task, and whatever a
    caller sets in :attr:`refusals` and :attr:`scores` (the simulator's devices; tests)."""

    def __init__(self, devices: Iterable[str] = ()) -> None:
        self.online: dict[str, bool] = dict.fromkeys(devices, True)
        self.liveness = _AllLive()
        self.changes = 0
        self.refusals: dict[str, str] = {}  # device -> why it refuses every task
        self.scores: dict[str, dict[str, float]] = {}  # held-out device -> its score of the global

    def set_online(self, device: str, online: bool) -> None:
        """A status came: ``device`` is online (or not)."""
        self.online[device] = online
        self.changes += 1

    def online_devices(self) -> list[str]:
        return sorted(d for d, up in self.online.items() if up)

    def live_devices(self) -> list[str]:
        return self.online_devices()

    def refusal(self, device: str, task: str, selection: DeviceSelection | None) -> str | None:
        return self.refusals.get(device)

    def holdout_score(self, device: str, task: str, request: CollectRequest) -> dict[str, float] | None:
        return self.scores.get(device)

    def ahead(self, task: str, round_: int) -> dict[str, int]:
        return {}


def unconfirmed(roster: Roster, answered: Iterable[str] = ()) -> dict[str, str]:
    """Online devices not heard live lately (not waited for), less those in ``answered``."""
    answered = set(answered)
    found = roster.liveness.unconfirmed(roster.online_devices())
    return {d: why for d, why in sorted(found.items()) if d not in answered}


class RoundCollector:
    """The waiting state of ``request``'s round; see the module docstring.

    Parameters
    ----------
    request
        The round.
    policy
        Deadline, extensions, ``min_participants`` and the fixed ``expected`` list.
    roster
        The devices as their statuses describe them.
    selection, held_out
        Which devices run the task (``None``: all), and those that only score its global.
    clock
        Seconds since the epoch (``time.time``); a test passes its own.
    said_short
        Task -> the last "cannot reach min_participants" said: kept across rounds by the caller,
        so the line is said once per task, again only on a change.
    """

    def __init__(
        self,
        request: CollectRequest,
        policy: CollectPolicy,
        roster: Roster,
        *,
        selection: DeviceSelection | None = None,
        held_out: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
        said_short: dict[str, tuple] | None = None,
    ) -> None:
        self.request, self.policy, self.roster, self.clock = request, policy, roster, clock
        self.task, self.selection, self.held_out = request.spec.name, selection, set(held_out)
        self.inbox = Inbox()
        #: The server chose whom to wait for (or the config did): the roster does not change it.
        self.fixed = bool(policy.expected) or request.participants is not None
        self.expected: set[str] = set()
        self.refused: dict[str, str] = {}  # device -> why it does not run the task
        self.scores: dict[str, dict[str, float]] = {}  # held-out device -> its score of the global
        self.deadline = float("inf")
        self.extensions = 0
        self.closed: str | None = None
        self._said_short = {} if said_short is None else said_short
        self._looked_short = False
        self._seen = roster.changes
        self._last_online: set[str] = set()

    # -- inputs -----------------------------------------------------------------------------
    def file(self, device: str, verdict: Update | LateUpdate | Refusal) -> None:
        """File admission's verdict on ``device``'s upload (``admission.file_verdict``)."""
        file_verdict(self.inbox, device, verdict)

    def open(self) -> float:
        """Start waiting, with whatever was filed so far (restored from a store): the deadline."""
        expected = set(self.policy.expected) or set(self.roster.live_devices())
        if self.request.participants is not None:  # the server chose: wait for those only
            expected = set(self.request.participants)
        self.expected = self._awaited(expected) - self.held_out
        self._last_online = set(self.roster.live_devices())
        self.deadline = self.clock() + self.policy.deadline_s
        return self.deadline

    def announced(self, deadline: float) -> bool:
        """The round's announcement came with ``deadline`` (a worker learns its rounds from them): the
        round's deadline from now on; ``True`` when it moved (an extension, or a restarted coordinator)."""
        moved = deadline != self.deadline
        self.deadline = deadline
        return moved

    def look(self) -> None:
        """Take in the roster if a status came since the last look (an O(N) look: not otherwise).

        Without a fixed list, a device that comes online mid-round (heard live) is awaited (it
        gets the retained announcement), one that goes offline is not; whoever answered counts.
        One awaited stays awaited while it says online, even with its heartbeat late (a long
        local training): liveness decides whom a round starts with, and who joins it.
        """
        if self.roster.changes == self._seen:
            return
        self._seen = self.roster.changes
        claims = self.roster.online_devices()
        online, live = set(claims), set(self.roster.liveness.live(claims))
        if not self.fixed:
            self.expected = (self.expected & online) | (live - self._last_online) | self.inbox.answered
        # A device that refused and takes the task again (its owner resumed it) is awaited again.
        back = {d for d in self.refused if d in live and self._refuses(d) is None}
        for d in back:
            del self.refused[d]
        self._last_online = live
        # A device that refuses the task (its status says so, at once) is not waited for.
        self.expected = self._awaited(self.expected | back) - self.held_out

    # -- the closing rule -------------------------------------------------------------------
    def step(self) -> str:
        """Where the round stands now: ``"answered"`` or ``"deadline"`` (closed: :attr:`closed`),
        ``"extend"`` (too few valid uploads at the deadline: a new one is set, the caller
        re-announces the round) or ``"wait"``."""
        answered = self.inbox.answered
        valid, need = len(answered), self.policy.min_participants
        everyone = bool(self.expected) and self.expected <= answered
        if everyone and valid >= need and not self._scoring():
            self.closed = "answered"
            return self.closed
        now = self.clock()
        # Short because devices refuse the task: said once everyone who takes it answered (the
        # round would only wait out its deadline), or at the deadline (some never came).
        if self.refused and valid < need and not self._looked_short and (everyone or now >= self.deadline):
            self._say_short(self.expected | answered)
            self._looked_short = True  # once a round: a change shows in the next round's look
        if now < self.deadline:
            return "wait"
        self._say_whom(self.expected - answered)
        if valid >= need or self.extensions >= self.policy.max_extensions:
            self.closed = "deadline"
            return self.closed
        self.extensions += 1
        self.deadline = now + self.policy.deadline_s
        log.warning(
            "task %s round %d: %d valid uploads < min_participants %d; extending the deadline (%d/%d)",
            self.task,
            self.request.round,
            valid,
            need,
            self.extensions,
            self.policy.max_extensions,
        )
        return "extend"

    def left(self) -> float:
        """Seconds until the deadline (never below 0)."""
        return max(0.0, self.deadline - self.clock())

    def outcome(self) -> list[Update | Rejection | LateUpdate | SatOut]:
        """What the round got, and a ``SatOut``: how it closed, who sat it out and why, what
        held-out devices scored and who was skipped as not live."""
        self._awaited(set(self.roster.online_devices()))  # note every online device that sat it out
        out: list[Update | Rejection | LateUpdate | SatOut] = list(self.inbox.values())
        if self.refused:
            log.info("round %d/%s: not run by %s", self.request.round, self.request.phase, self.refused)
        self._scoring()  # the scores that came with the last messages
        skipped = {} if self.fixed else unconfirmed(self.roster, self.inbox.answered)
        refused, scores = dict(sorted(self.refused.items())), dict(sorted(self.scores.items()))
        out.append(SatOut(self.closed or "deadline", refused, scores, skipped))
        return out

    # -- the roster's say -------------------------------------------------------------------
    def _refuses(self, device: str) -> str | None:
        return self.roster.refusal(device, self.task, self.selection)

    def _awaited(self, devices: set[str]) -> set[str]:
        """``devices`` less those outside the selection or that refused the task (noted)."""
        out = set()
        for d in devices:
            why = self._refuses(d)
            if why is None or isinstance(self.inbox.get(d), Update):
                out.add(d)
            else:
                self.refused[d] = why
        return out

    def _scoring(self) -> set[str]:
        """Held-out devices online that have not yet scored this round's global (noted when they have)."""
        waiting = set()
        for d in self.held_out:  # a few devices: never a scan of the whole (possibly 10k) fleet
            if not self.roster.online.get(d) or not self.roster.liveness.is_live(d):
                continue  # a held-out device that is away (or only retained "online") is not awaited
            score = self.roster.holdout_score(d, self.task, self.request)
            if score is not None:
                self.scores[d] = score
            elif self._refuses(d) is None:
                waiting.add(d)
        return waiting

    def _say_whom(self, missing: set[str]) -> None:
        """At a deadline: which awaited devices did not answer, and which trained past this round
        already (the store is behind them: ``serve --resume-from-devices``)."""
        request = self.request
        where = f"task {self.task} round {request.round}/{request.phase}"
        if missing:
            named = sorted(missing)
            more = f" and {len(named) - NAMED} more" if len(named) > NAMED else ""
            log.warning("%s: deadline passed waiting for %s%s", where, ", ".join(named[:NAMED]), more)
        ahead = self.roster.ahead(self.task, request.round)
        if not ahead:
            return
        named = sorted(ahead, key=lambda d: (-ahead[d], d))
        more = f" and {len(named) - NAMED} more" if len(named) > NAMED else ""
        log.warning(
            "%s: %d device(s) trained past it already, they ignore it: %s%s. This store is behind "
            "its devices (an older aggregator.sqlite, or a fresh one): restart with "
            "`cloud-aggregator serve --resume-from-devices` to go on from round %d",
            where,
            len(ahead),
            ", ".join(f"{d} (round {ahead[d]}, {ahead[d] - request.round + 1} ahead)" for d in named[:NAMED]),
            more,
            max(ahead.values()) + 1,
        )

    def _say_short(self, takers: set[str]) -> None:
        """Say in one line when devices refusing the task leave its rounds short of ``min_participants``
        (``takers``: the online devices that take it): otherwise each round would wait out its deadline
        and extensions and be abandoned, with nothing naming the cause.  Said once per task, again only
        when who takes it or who refuses it changes."""
        need = self.policy.min_participants
        if len(takers) >= need:
            return
        key = (tuple(sorted(takers)), tuple(sorted(self.refused.items())))
        if self._said_short.get(self.task) == key:
            return
        self._said_short[self.task] = key
        whys = "; ".join(f"{d} refuses it: {why}" for d, why in sorted(self.refused.items()))
        log.warning(
            "task %s: its rounds cannot reach [collect] min_participants = %d with the devices online: "
            "%d take it (%s); %s. Each round waits deadline_s, is extended %d times, then abandoned: "
            "lower min_participants, or bring devices that can run the task",
            self.task,
            need,
            len(takers),
            ", ".join(sorted(takers)) or "none",
            whys,
            self.policy.max_extensions,
        )

"""The device's side of buffered asynchronous rounds (FedBuff), and a simulated machine's pace.

Buffered (an announcement with ``mode = "buffered"``, ``cloud_aggregator.serve.buffered_mqtt``): the
retained announcement is the newest global, version ``round - 1``.  The device trains from the
newest one it has and uploads quoting its hash and a round of its own, ``max(announcement
round, last answered round + 1)`` (the numbering of ``BufferedServer.dispatch``), then starts
again at once from the newest it has by then -- the same global again if none came meanwhile,
as in the simulator.  A job the daemon declines (paused by its owner, the task refused, no rows
yet) starts no next one: the next announcement (or the owner's resume) does.  The training and the upload are the daemon's own round code: the
:class:`Pacer` hands it the announcement with the job's round (:meth:`Pacer.step`).

Simulated pace (``[simulate]``, :class:`edge.config.SimulateConfig`; off on a real machine):
an answer leaves ``update_s`` × jitter seconds after the announcement it trains from came, and
the device leaves and comes back.  Away, it publishes its retained status offline (what its
Last Will says when it drops), loses the job in progress and answers nothing; back, it says
online and answers the newest announcement it has (the retained one a reconnect would get).
Nothing sleeps: the daemon's loop (or the swarm's) calls :meth:`Pacer.step`, which does what
is due, and :attr:`Pacer.next_at` says when that is.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from edge.config import SimulateConfig
from ioft_protocol.round_messages import Announcement


@dataclass
class _Job:
    """An answer in progress: trained from ``ann``, sent at ``due`` (monotonic seconds)."""

    ann: Announcement
    due: float


class Pacer:
    """Which announcement the daemon trains on, and when (module docstring).

    Parameters
    ----------
    device
        The device id (seeds its draws).
    sim
        Its simulated pace (all 0: buffered tasks only, at full speed).
    run
        Trains on an announcement and uploads (the daemon's ``on_announcement``).
    answered
        The last round the device answered for a task (``None``: none yet).
    presence
        Publishes the device's retained status online (``True``) or offline.
    clock
        Monotonic seconds.
    """

    def __init__(
        self,
        device: str,
        sim: SimulateConfig,
        run: Callable[[Announcement], None],
        answered: Callable[[str], int | None],
        presence: Callable[[bool], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sim, self._run, self._answered, self._presence, self._clock = sim, run, answered, presence, clock
        self._rng = np.random.default_rng([sim.seed, zlib.crc32(device.encode())])
        self.latest: dict[str, Announcement] = {}  # task -> newest announcement of a paced task
        self.jobs: dict[str, _Job] = {}
        self.away = False
        self._toggle = self._clock() + self._draw_leave() if sim.leave_per_s > 0 else math.inf
        self._releasing: Announcement | None = None
        #: Monotonic time of the next thing due (``inf``: nothing is).
        self.next_at = self._toggle

    @property
    def paced(self) -> bool:
        """Whether synchronous rounds are paced too (a simulated speed or churn)."""
        return self.sim.update_s > 0 or self.sim.leave_per_s > 0

    def hold(self, ann: Announcement) -> bool:
        """Whether the daemon leaves ``ann`` to the pacer (answered later by :meth:`step`)."""
        if ann is self._releasing:
            return False
        if ann.state == "done":
            self.latest.pop(ann.task, None)
            self.jobs.pop(ann.task, None)
            return False
        if ann.mode != "buffered" and not self.paced:
            return False
        newest = self.latest.get(ann.task)
        if newest is None or ann.round >= newest.round:
            self.latest[ann.task] = ann
        if self.away:
            return True
        job = self.jobs.get(ann.task)
        if ann.mode == "buffered":
            if job is None:
                self._start(ann.task)
        elif job is None or (job.ann.round, job.ann.phase, job.ann.global_hash) != (
            ann.round,
            ann.phase,
            ann.global_hash,
        ):
            self._start(ann.task)  # a new round (a re-announcement of the same one keeps its time)
        return True

    def step(self) -> None:
        """Leave, come back, and send the answers that are due."""
        now = self._clock()
        if now >= self._toggle:
            self._switch(now)
        for task, job in list(self.jobs.items()):
            if job.due > now or self.jobs.get(task) is not job:
                continue
            del self.jobs[task]
            if job.ann.mode != "buffered":
                self._release(job.ann)
                continue
            last = self._answered(task)
            self._release(replace(job.ann, round=max(job.ann.round, (last or 0) + 1)))
            trained = self._answered(task) != last  # not when paused, refusing, or without rows
            if trained and task in self.latest and not self.away:
                self._start(task)  # and at once again, from the newest global it has
        self._schedule()

    def _release(self, ann: Announcement) -> None:
        """Hand ``ann`` to the daemon's round code (which :meth:`hold` then lets through)."""
        self._releasing = ann
        try:
            self._run(ann)
        finally:
            self._releasing = None

    def _switch(self, now: float) -> None:
        self.away = not self.away
        if self.away:
            self.jobs.clear()  # the update it was computing is lost
            self._toggle = now + float(self._rng.exponential(self.sim.away_s))
        else:
            self._toggle = now + self._draw_leave()
        self._presence(not self.away)
        if not self.away:
            for task in self.latest:
                self._start(task)

    def _start(self, task: str) -> None:
        jitter = math.exp(self.sim.jitter * float(self._rng.standard_normal())) if self.sim.jitter else 1.0
        self.jobs[task] = _Job(self.latest[task], self._clock() + self.sim.update_s * jitter)
        self._schedule()

    def _draw_leave(self) -> float:
        return float(self._rng.exponential(1.0 / self.sim.leave_per_s))

    def _schedule(self) -> None:
        self.next_at = min([self._toggle, *(j.due for j in self.jobs.values())])

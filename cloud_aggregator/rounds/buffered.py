"""Buffered asynchronous rounds (FedBuff): who trains from which version, and every arrival admitted.

A :class:`BufferedServer` hands each device that asks for work a :class:`Job`: the current
global, its version and hash, and the round number the device quotes.  When the device's
upload arrives it passes the one admission pipeline (:meth:`cloud_aggregator.rounds.admission.Admission.receive`)
against a ``CollectRequest`` for that job -- the job's round, phase and starting global --
so decoding, identity, task, tensor, replay and norm checks are the same code as in a
synchronous round.  An admitted upload goes to the :class:`~cloud_aggregator.aggregation.fedbuff.UpdateBuffer`,
which weighs it by its staleness and moves the global every ``k`` arrivals.

Round numbers: a job's round is the pulled version + 1, bumped past the device's previous job
(``trainer_lite.client.participate`` reads it as the fleet round: a device whose first job
starts from a trained global is cold-started, as in a synchronous fleet, and its own round
counter and minibatch stream advance with every job).

Over MQTT (:mod:`cloud_aggregator.serve.buffered_mqtt`) nobody hands out jobs: a device pulls the
retained global itself and its upload says which one (its ``global_hash``) and under which
round number.  :meth:`BufferedServer.take` recovers the job from that -- the version must be
one of the last ``keep_recent`` globals, the round at least the version + 1 and past the
device's previous job -- and then admits it exactly as :meth:`BufferedServer.receive` does.

The ledger adds up: ``arrived == buffered + too_stale + refused`` and, as a refused upload
leaves its job outstanding (the device may resend), ``dispatched == buffered + too_stale +
abandoned + outstanding`` (:meth:`BufferedServer.ledger`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cloud_aggregator.aggregation.fedbuff import Arrival, BufferConfig, UpdateBuffer
from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import Admission, AdmissionPolicy, Inbox
from cloud_aggregator.rounds.task_rules import buffered_refusal
from cloud_aggregator.rounds.types import CollectRequest, Reason, Refusal
from ioft_protocol.round_messages import UpdateMessage
from trainer_lite.params import Params, param_hash
from trainer_lite.task import TaskSpec


@dataclass(frozen=True)
class Job:
    """One device's piece of work: train from ``params`` (global ``version``) and upload as ``round``."""

    device: str
    round: int
    version: int
    params: Params
    global_hash: str


class BufferedServer:
    """FedBuff over a fleet: jobs out, admitted uploads into the buffer.

    Parameters
    ----------
    spec
        The task (its strategy's ``init_global`` is version 0).
    config
        The buffer's ``k``, ``η_g``, ``s(τ)`` and ``max_staleness``.
    fleet
        The fleet id uploads must name.
    admission
        Bounds of the admission pipeline's norm check, or the pipeline itself (a fleet's).
    keep_recent
        Globals of the last this many versions are kept for :meth:`take` (devices that pull
        the global themselves); 0: only those an outstanding job started from.
    """

    def __init__(
        self,
        spec: TaskSpec,
        config: BufferConfig | None = None,
        *,
        fleet: str = "sim",
        admission: AdmissionPolicy | Admission | None = None,
        keep_recent: int = 0,
    ) -> None:
        self.spec = spec
        self.strategy = make_strategy(spec)
        why = buffered_refusal(spec, self.strategy)
        if why:
            raise ValueError(why)
        self.phase = self.strategy.phases()[0]
        self.buffer = UpdateBuffer(self.strategy.init_global(), config)
        self.admission = admission if isinstance(admission, Admission) else Admission(fleet, admission)
        self.keep_recent = keep_recent
        self.jobs: dict[str, Job] = {}
        self._last_round: dict[str, int] = {}
        self._versions: dict[int, tuple[Params, str]] = {}
        self._by_hash: dict[str, int] = {}  # every version's hash -> the version, for take()
        self._counts = dict.fromkeys(
            ("dispatched", "arrived", "abandoned", "buffered", "too_stale", "refused"), 0
        )

    @property
    def global_params(self) -> Params:
        return self.buffer.global_params

    @property
    def version(self) -> int:
        return self.buffer.version

    def current(self) -> tuple[int, Params, str]:
        """The current version, its global and the global's hash (what a device is sent or pulls)."""
        version = self.buffer.version
        if version not in self._versions:
            digest = param_hash(self.buffer.global_params)
            self._versions[version] = (self.buffer.global_params, digest)
            self._by_hash[digest] = version
        params, digest = self._versions[version]
        return version, params, digest

    def resume(self, version: int, global_params: Params, recent: Mapping[int, Params]) -> None:
        """Continue from a stored ``version`` (an aggregator restart); ``recent``: earlier versions'
        globals, so uploads trained from them are still judged.  Outstanding jobs and the buffer are gone."""
        self.buffer.restart_at(global_params, version)
        self.jobs.clear()
        for v, params in sorted(recent.items()):
            if v < version:
                digest = param_hash(params)
                self._versions[v], self._by_hash[digest] = (params, digest), v
        self.current()
        self._prune()

    def dispatch(self, device: str) -> Job:
        """A new job for ``device`` from the current global; an outstanding one is abandoned."""
        return self._job(device, max(self.version + 1, self._last_round.get(device, 0) + 1), self.version)

    def _job(self, device: str, round_: int, version: int) -> Job:
        if device in self.jobs:
            self.abandon(device)
        if version == self.version:
            self.current()
        params, digest = self._versions[version]
        self._last_round[device] = round_
        job = Job(device, round_, version, params, digest)
        self.jobs[device] = job
        self._counts["dispatched"] += 1
        return job

    def take(self, device: str, upload: UpdateMessage) -> Arrival | Refusal:
        """Admit the upload of a device that pulled a global itself (module docstring).

        The job is the one ``upload`` quotes: the version whose hash it names, its round.  An
        upload from a version more than ``max_staleness`` behind is refused (``stale_round``, and
        counted ``too_stale``); one from a global never published or no longer kept
        (``wrong_global``), one quoting a round before its version's (``stale_round``), and a
        repeat of a round already taken (``replay``) are refused before admission.
        """
        version = self._by_hash.get(upload.global_hash)
        job = self.jobs.get(device)
        limit = self.buffer.config.max_staleness
        too_stale = False
        if version is None:
            why = Refusal(Reason.WRONG_GLOBAL, f"global {upload.global_hash[:12]!r} was never published here")
        elif upload.round < version + 1:
            why = Refusal(Reason.STALE_ROUND, f"round {upload.round} quoted from version {version}")
        elif job is not None and job.round == upload.round and job.version == version:
            return self.receive(device, upload)  # a resend of an upload admission refused
        elif upload.round <= self._last_round.get(device, 0):
            why = Refusal(Reason.REPLAY, f"device already sent round {upload.round} or a later one")
        elif limit is not None and self.version - version > limit:
            too_stale = True
            why = Refusal(
                Reason.STALE_ROUND,
                f"trained from version {version}: {self.version - version} versions old > max_staleness {limit}",
            )
        elif version not in self._versions:
            why = Refusal(Reason.WRONG_GLOBAL, f"version {version} is no longer kept (keep_recent)")
        else:
            self._job(device, upload.round, version)
            return self.receive(device, upload)
        self._counts["arrived"] += 1
        self._counts["too_stale" if too_stale else "refused"] += 1
        if too_stale:
            self._counts["dispatched"] += 1  # the job it did, recovered only to be dropped
            self._last_round[device] = upload.round
        self.admission.count_refusal(device, why.reason)
        return why

    def abandon(self, device: str) -> None:
        """``device`` left (or was given new work): its outstanding job will never count."""
        if self.jobs.pop(device, None) is not None:
            self._counts["abandoned"] += 1
            self._prune()

    def receive(self, device: str, upload: bytes | UpdateMessage) -> Arrival | Refusal:
        """Admit ``device``'s upload against its outstanding job and buffer it.

        An upload with no outstanding job (a copy of one already counted, or from a device
        never given work) is refused by admission as arriving while no round is open for it.
        """
        job = self.jobs.get(device)
        request = None if job is None else self.request(job.round, job.params, job.global_hash)
        verdict = self.admission.receive(device, upload, request, Inbox())
        if job is not None and not isinstance(verdict, Refusal):
            del self.jobs[device]
        self._counts["arrived"] += 1
        if isinstance(verdict, Refusal):
            self._counts["refused"] += 1
            return verdict
        if not isinstance(verdict, Update):  # no late window is ever opened here
            raise TypeError(f"admission returned {type(verdict).__name__} for a buffered job")
        arrival = self.buffer.add(verdict.params, job.params, job.version)
        self._counts["too_stale" if arrival.dropped else "buffered"] += 1
        self._prune()
        return arrival

    def request(self, round_: int, params: Params, global_hash: str) -> CollectRequest:
        """The round an upload quoting ``round_`` from the global ``params`` is judged against
        (a job's, or the one announced); the phase is the strategy's one."""
        return CollectRequest(
            self.spec, round_, self.phase, params, global_hash, {}, self.strategy.expected(params, self.phase)
        )

    def ledger(self) -> Mapping[str, int]:
        """Counts that add up (module docstring), plus ``outstanding`` and ``applied`` server updates."""
        return {**self._counts, "outstanding": len(self.jobs), "applied": self.buffer.version}

    def _prune(self) -> None:
        """Keep only the versions an outstanding job started from, the current one and the last ``keep_recent``."""
        live = {j.version for j in self.jobs.values()} | {self.buffer.version}
        recent = self.buffer.version - self.keep_recent
        self._versions = {v: p for v, p in self._versions.items() if v in live or v > recent}
        if len(self._by_hash) > 4 * (self.keep_recent + 256):  # hashes are small; keep many, not all
            oldest = self.buffer.version - 2 * (self.keep_recent + 256)
            self._by_hash = {h: v for h, v in self._by_hash.items() if v >= oldest}

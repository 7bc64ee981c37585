"""Buffered asynchronous rounds (FedBuff): who trains from which version, and every arrival admitted.

A :class:`BufferedServer` hands each device that asks for work a :class:`Job`: the current
global, its version and hash, and the round number the device quotes.  When the device's
upload arrives it passes the one admission pipeline (:meth:`cloud_aggregator.admission.Admission.receive`)
against a ``CollectRequest`` for that job -- the job's round, phase and starting global --
so decoding, identity, task, tensor, replay and norm checks are the same code as in a
synchronous round.  An admitted upload goes to the :class:`~cloud_aggregator.fedbuff.UpdateBuffer`,
which weighs it by its staleness and moves the global every ``k`` arrivals.

Round numbers: a job's round is the pulled version + 1, bumped past the device's previous job
(``trainer_lite.client.participate`` reads it as the fleet round: a device whose first job
starts from a trained global is cold-started, as in a synchronous fleet, and its own round
counter and minibatch stream advance with every job).

The ledger adds up: ``arrived == buffered + too_stale + refused`` and, as a refused upload
leaves its job outstanding (the device may resend), ``dispatched == buffered + too_stale +
abandoned + outstanding`` (:meth:`BufferedServer.ledger`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cloud_aggregator.admission import Admission, AdmissionPolicy, Inbox, Refusal
from cloud_aggregator.fedbuff import Arrival, BufferConfig, UpdateBuffer
from cloud_aggregator.rounds import CollectRequest
from cloud_aggregator.strategies import Strategy, Update, make_strategy
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


def buffered_refusal(spec: TaskSpec, strategy: Strategy) -> str | None:
    """Why ``spec`` cannot run buffered, or ``None``: the delta form needs a global that is a
    weighted mean of uploads of its own shape, one phase, and no DP or SecAgg (whose sums are per round)."""
    if not strategy.accepts_late_updates:
        return (
            f"algorithm {spec.algorithm!r} (server {strategy.name!r}) does not combine uploads as a "
            "weighted mean; buffered rounds need a fedavg-served algorithm (fedavg, pflda, fedrep ...)"
        )
    if len(strategy.phases()) != 1:
        return f"algorithm {spec.algorithm!r} has phases {list(strategy.phases())}; buffered rounds need one"
    if spec.dp is not None or spec.secagg is not None:
        return "dp and secagg account per synchronous round; run this task with mode = 'sync'"
    return None


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
        Bounds of the admission pipeline's norm check.
    """

    def __init__(
        self,
        spec: TaskSpec,
        config: BufferConfig | None = None,
        *,
        fleet: str = "sim",
        admission: AdmissionPolicy | None = None,
    ) -> None:
        self.spec = spec
        self.strategy = make_strategy(spec)
        why = buffered_refusal(spec, self.strategy)
        if why:
            raise ValueError(why)
        self.phase = self.strategy.phases()[0]
        self.buffer = UpdateBuffer(self.strategy.init_global(), config)
        self.admission = Admission(fleet, admission)
        self.jobs: dict[str, Job] = {}
        self._last_round: dict[str, int] = {}
        self._versions: dict[int, tuple[Params, str]] = {}
        self._counts = dict.fromkeys(
            ("dispatched", "arrived", "abandoned", "buffered", "too_stale", "refused"), 0
        )

    @property
    def global_params(self) -> Params:
        return self.buffer.global_params

    @property
    def version(self) -> int:
        return self.buffer.version

    def dispatch(self, device: str) -> Job:
        """A new job for ``device`` from the current global; an outstanding one is abandoned."""
        if device in self.jobs:
            self.abandon(device)
        version = self.buffer.version
        if version not in self._versions:
            self._versions[version] = (self.buffer.global_params, param_hash(self.buffer.global_params))
        params, digest = self._versions[version]
        round_ = max(version + 1, self._last_round.get(device, 0) + 1)
        self._last_round[device] = round_
        job = Job(device, round_, version, params, digest)
        self.jobs[device] = job
        self._counts["dispatched"] += 1
        return job

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
        request = None if job is None else self.request(job)
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

    def request(self, job: Job) -> CollectRequest:
        """The round admission judges ``job``'s upload against: its round, phase and starting global."""
        return CollectRequest(
            self.spec,
            job.round,
            self.phase,
            job.params,
            job.global_hash,
            {},
            self.strategy.expected(job.params, self.phase),
        )

    def ledger(self) -> Mapping[str, int]:
        """Counts that add up (module docstring), plus ``outstanding`` and ``applied`` server updates."""
        return {**self._counts, "outstanding": len(self.jobs), "applied": self.buffer.version}

    def _prune(self) -> None:
        """Keep only the versions an outstanding job started from (and the current one)."""
        live = {j.version for j in self.jobs.values()} | {self.buffer.version}
        self._versions = {v: p for v, p in self._versions.items() if v in live}

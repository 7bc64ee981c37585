"""The words the round engine, admission, stragglers and every fleet share: what a fleet is asked
for (:class:`CollectRequest`) and what it answers (``Update``, :class:`Rejection`, :class:`LateUpdate`,
:class:`SatOut`), why an upload was refused (:class:`Reason`, :class:`Refusal`), what a round leaves
(:class:`RoundRecord`), and what a fleet and a store must offer (:class:`Fleet`, :class:`RoundStore`).
They live apart from the modules that use them so that none of those needs another to name them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from cloud_aggregator.aggregation.streaming import RoundFold
from cloud_aggregator.aggregation.update import Update
from ioft_protocol.codec import TensorSpec
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec


class Reason(StrEnum):
    """Why an upload was refused (see the module docstring for each step)."""

    MALFORMED = "malformed"
    NO_ROUND = "no_round"
    IMPERSONATION = "impersonation"
    WRONG_TASK = "wrong_task"
    STALE_ROUND = "stale_round"
    FUTURE_ROUND = "future_round"
    WRONG_GLOBAL = "wrong_global"
    NOT_SELECTED = "not_selected"
    SHAPE_DTYPE = "shape_dtype"
    NON_FINITE = "non_finite"
    REPLAY = "replay"
    NORM = "norm"
    N_SAMPLES = "n_samples"
    METRICS = "metrics"
    #: A copy of an upload already counted: routine, not refused as an attack (see ``replay``).
    RESENT = "resent"
    #: Stored before reason codes had their own column, with no code in its text.
    OTHER = "other"


@dataclass(frozen=True)
class Refusal:
    """Why an upload was not admitted: a :class:`Reason` and what exactly was wrong."""

    reason: Reason
    detail: str
    #: Screened out before its payload was read (held out, or outside the task's selection): the
    #: device sat the round out, which the fleet's ``SatOut`` says; counted, not filed as a rejection.
    sat_out: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclass(frozen=True)
class LateWindow:
    """The round before the open one, whose stragglers may still count (``next_round``)."""

    round: int
    phase: str
    global_hash: str  # the global that round started from: a late upload must quote it
    global_params: Params
    counted: frozenset[str]  # devices already aggregated in that round


@dataclass(frozen=True)
class LateUpdate:
    """A straggler's upload for ``LateWindow.round``, delivered while the next round is open."""

    update: Update
    round: int


@dataclass(frozen=True)
class CollectRequest:
    """What the fleet is asked for in one round and phase."""

    spec: TaskSpec
    round: int
    phase: str
    global_params: Params
    global_hash: str
    downlinks: dict[str, Params]
    expected: dict[str, TensorSpec]
    participants: tuple[str, ...] | None = None  # the server's selection; None: the fleet samples
    expected_by_device: dict[str, dict[str, TensorSpec]] = field(default_factory=dict)
    late: LateWindow | None = None  # set only when stragglers count in the next round
    #: Set where the strategy streams (``cloud_aggregator.aggregation.streaming``): the fleet folds each
    #: upload admission admitted into it once the upload is durable, and files the ``Update`` without
    #: its params.
    fold: RoundFold | None = field(default=None, compare=False)
    #: The most samples one upload counts, where the fold is done elsewhere (``[collect] workers``):
    #: announced with the round, each worker cuts what it folds to it (``cloud_aggregator.serve.workers``).
    max_samples: int | None = None
    #: ``[task.compress] downlink``: the codes ``global_params`` (already decoded from them) go down
    #: as, and the announcement's ``downlink`` field (``ioft_protocol.downlink``); ``None``: float32.
    downlink: tuple[dict[str, Any], dict[str, Any]] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Rejection:
    """An upload that failed validation: counted per device, never aggregated."""

    device: str
    reason: str


@dataclass
class RoundRecord:
    """What happened in one round and phase (written to the store)."""

    task: str
    round: int
    phase: str
    status: str  # "completed" or "abandoned"
    participants: list[str]
    n_samples: dict[str, int]
    metrics: dict[str, dict[str, float]]
    rejected: dict[str, str]
    global_hash: str
    started: float
    finished: float
    extra: dict[str, Any] = field(default_factory=dict)

    def mean_metric(self, name: str) -> float | None:
        values = [m[name] for m in self.metrics.values() if name in m]
        return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class SatOut:
    """Online devices that sat a round out (outside the task's selection, or refusing it), with
    their reasons, and how the round closed (``"answered"`` or ``"deadline"``); a fleet that
    knows returns one among its replies."""

    closed: str
    refused: dict[str, str]
    #: held-out device -> its score of the round's global (``[[task]] holdout``)
    holdout: dict[str, dict[str, float]] = field(default_factory=dict)
    #: devices that said online but were not heard live, so not waited for -> why
    #: (``cloud_aggregator.serve.liveness``)
    skipped: dict[str, str] = field(default_factory=dict)


#: An admitted upload to keep: ``(task, round, phase, device, global_hash, payload)``.
StoredUpload = tuple[str, int, str, str, str, bytes]
#: A refused upload to record: ``(task, round, device, reason, detail)``.
StoredRefusal = tuple[str, "int | None", str, Reason, str]


class Fleet(Protocol):
    """Delivers a round to devices and returns what admission made of their uploads.

    At most one ``Update`` per device: each passed ``cloud_aggregator.rounds.admission.Admission``.
    """

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection | LateUpdate | SatOut]: ...


class RoundStore(Protocol):
    """Durable state: completed phases and their globals, uploads as they arrive, refusals."""

    def resume_point(self, task: str) -> tuple[int, int, Params, dict[str, Any]] | None:
        """``(round, phase_index, global, strategy_state)`` to start from, or ``None``."""

    def save(
        self, record: RoundRecord, next_point: tuple[int, int], global_params: Params, state: dict
    ) -> None:
        """Atomically record a finished phase and the point to resume from."""

    def rounds(self, task: str) -> list[RoundRecord]:
        """``task``'s recorded phases, in round order."""

    def get_params(self, digest: str) -> Params:
        """A global saved by :meth:`save`, by its ``param_hash``."""

    def put_update(
        self, task: str, round_: int, phase: str, device: str, global_hash: str, payload: bytes
    ) -> bool:
        """Keep an admitted upload until its round is saved; ``False`` if that device's is kept already."""

    def put_batch(self, updates: Sequence[StoredUpload], rejections: Sequence[StoredRefusal]) -> None:
        """:meth:`put_update` and :meth:`put_rejection` for a drained batch, durable together on return."""

    def stored_updates(self, task: str, round_: int, phase: str, global_hash: str) -> list[tuple[str, bytes]]:
        """``(device, payload)`` of the uploads kept for a round that has not been saved."""

    def put_partial(
        self,
        task: str,
        round_: int,
        phase: str,
        global_hash: str,
        state: bytes,
        folded: dict[str, tuple[int, dict[str, float]]],
    ) -> None:
        """Checkpoint a streaming round's partial sum; drop the stored uploads of ``folded`` devices."""

    def partial(
        self, task: str, round_: int, phase: str, global_hash: str
    ) -> tuple[bytes, dict[str, tuple[int, dict[str, float]]]] | None:
        """The round's last checkpoint and ``{device: (n_samples, metrics)}`` folded in it, or ``None``."""

    def put_rejection(self, task: str, round_: int | None, device: str, reason: Reason, detail: str) -> None:
        """Record a refused upload with its reason code."""

    def rejection_counts(self, task: str | None = None) -> dict[str, int]:
        """``{device: refusals}`` (of ``task``, or all)."""

    def rejection_counts_by_reason(self, task: str | None = None) -> dict[str, dict[str, int]]:
        """``{device: {reason code: refusals}}`` (of ``task``, or all)."""

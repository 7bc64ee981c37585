"""A task's state on the device: personal parameters, the last answered round and its upload,
in one atomically written file per task, so a kill at any instant leaves the state before or
after a round and a computed upload is re-sent, never recomputed.

:class:`TaskStates` holds every task's state in the daemon: kept, read from its file, or fresh
where its training changed; and whether an announcement comes for a round answered already.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ioft_protocol.round_messages import Announcement
from ioft_protocol.state import StateError, load_verified, save_arrays
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.client import initial_local
from trainer_lite.params import Params, strip_prefix, with_prefix
from trainer_lite.task import training_changes

log = logging.getLogger(__name__)

UPLOAD = "upload"
#: Puts a task state's bytes in its file, atomically and durably before the upload leaves.
Write = Callable[[str | Path, bytes], None]


@dataclass
class TaskState:
    """One task's state on this device: personal parameters and the last answered round."""

    spec_json: str
    local: Params
    answered: tuple[int, str] | None = None
    upload: Params = field(default_factory=dict)
    upload_meta: dict = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@functools.lru_cache(maxsize=65536)
def task_state_path(state_dir: Path, task: str) -> Path:
    """Where the task's state lives under the device's state directory (made once per device and
    task: three ``pathlib`` joins cost a swarm's device more than its own round's bookkeeping)."""
    return state_dir / "tasks" / task / "local.safetensors"


def save_task_state(path: Path, state: TaskState, write: Write | None = None) -> None:
    """One atomic file per task (``ioft_protocol.state.save_arrays``): a kill leaves the old or the new state.

    ``write``: how the bytes reach the file (``None``: durable on return; a swarm's group commit)."""
    arrays = {**with_prefix(state.local, "local"), **with_prefix(state.upload, UPLOAD)}
    meta = {
        "spec": state.spec_json,
        "answered": list(state.answered) if state.answered else None,
        "upload_meta": state.upload_meta,
        "metrics": state.metrics,
    }
    save_arrays(path, arrays, meta, write)


def load_task_state(path: Path) -> TaskState | None:
    """The verified state (falling back to the previous copy), ``None`` if never written.

    A copy whose checksums pass but whose metadata lacks a key or holds one of the
    wrong type (:func:`_task_state_from`) counts as corrupt too, so the previous copy
    is tried.

    Raises
    ------
    StateError
        When copies exist but none verifies (the daemon then starts the task afresh).
    """
    return load_verified(path, _task_state_from)


def _task_state_from(arrays: dict[str, np.ndarray], meta: dict) -> TaskState:
    """What ``save_task_state`` wrote, checked key by key; ``ValueError`` names the first bad one."""
    spec = meta.get("spec")
    if not isinstance(spec, str):
        raise ValueError(f"task state: spec must be a string, got {type(spec).__name__}")
    answered = meta.get("answered")
    if answered is not None:
        ok = isinstance(answered, list) and len(answered) == 2
        if not (ok and _is_int(answered[0]) and isinstance(answered[1], str)):
            raise ValueError(f"task state: answered must be null or [round, phase], got {answered!r:.80}")
        answered = (answered[0], answered[1])
    upload_meta = meta.get("upload_meta", {})
    metrics = meta.get("metrics", {})
    if not isinstance(upload_meta, dict) or not isinstance(metrics, dict):
        raise ValueError("task state: upload_meta and metrics must be objects")
    if answered is not None and not (
        _is_int(upload_meta.get("n_samples")) and isinstance(upload_meta.get("global_hash"), str)
    ):
        raise ValueError("task state: an answered round needs upload_meta.n_samples and .global_hash")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in metrics.values()):
        raise ValueError("task state: metrics must be numbers")
    return TaskState(
        spec_json=spec,
        local=strip_prefix(arrays, "local"),
        answered=answered,
        upload=strip_prefix(arrays, UPLOAD),
        upload_meta=upload_meta,
        metrics=metrics,
    )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TaskStates:
    """Every task's state on one device (``by_task``), and the tasks whose announced round is below
    the one this device trained (``ahead``, in its status: ``serve --resume-from-devices``).

    ``publish_status()`` sends the device's retained status (a newly noted ``ahead``).
    """

    def __init__(self, state_dir: Path, device: str, publish_status: Callable[[], None]) -> None:
        self.state_dir, self.device = Path(state_dir), device
        self.publish_status = publish_status
        self.by_task: dict[str, TaskState] = {}
        #: task -> the round this device trained and the (lower) one announced (:meth:`note_ahead`)
        self.ahead: dict[str, dict[str, object]] = {}
        #: how a state reaches its file: ``None``, durable at once (each save fsync'ed); a swarm
        #: sets its group commit's (``edge.group_commit``: durable before the swarm next sends)
        self.write: Write | None = None

    def get(self, task: str, spec_json: str, algo: ClientAlgorithm) -> TaskState:
        """The task's state: kept, read from its file, or fresh where there is none or its training changed."""
        state = self.by_task.get(task)
        if state is None:
            try:
                state = load_task_state(task_state_path(self.state_dir, task))
            except StateError as exc:
                log.error("%s: %s; starting task %s afresh", self.device, exc, task)
        changed = None if state is None else training_changes(state.spec_json, spec_json)
        if state is None or changed:
            if state is not None:
                log.info("%s: task %s changed %s; resetting its local state", self.device, task, changed)
            state = TaskState(spec_json=spec_json, local=initial_local(algo, self.device))
        elif state.spec_json != spec_json:  # more rounds: the same training goes on
            state.spec_json = spec_json
        self.by_task[task] = state
        return state

    def keep(self, task: str, state: TaskState) -> None:
        """The round's new state, durable on disk before its upload is sent."""
        save_task_state(task_state_path(self.state_dir, task), state, self.write)
        self.by_task[task] = state

    def answered_round(self, task: str) -> int | None:
        """The round this device answered last for ``task`` (``None``: none yet)."""
        state = self.by_task.get(task)
        return None if state is None or state.answered is None else state.answered[0]

    def answered_before(self, ann: Announcement, state: TaskState, resend: Callable[[], None]) -> bool:
        """Whether this device trained this round already (its kept upload is re-sent by ``resend``:
        the aggregator may have lost it) or a later one (a stale announcement: noted in its status)."""
        if state.answered is not None and (ann.round, ann.phase) == state.answered:
            if state.upload_meta.get("global_hash") == ann.global_hash:
                resend()
            else:  # this round was trained from another global: the aggregator's store lost it
                self.note_ahead(ann, state.answered[0])
            return True
        if state.answered is not None and ann.round < state.answered[0]:
            self.note_ahead(ann, state.answered[0])
            return True
        if self.ahead.pop(ann.task, None) is not None:
            log.info("%s: task %s: the aggregator is at round %d again", self.device, ann.task, ann.round)
        return False

    def note_ahead(self, ann: Announcement, device_round: int) -> None:
        """An announcement below the round this device trained last: its status says so (once per
        announced round) for ``serve`` to tell its operator, who resumes it past this round."""
        ahead = {"task": ann.task, "device_round": device_round, "announced_round": ann.round}
        if ann.state != "running" or self.ahead.get(ann.task) == ahead:
            return
        self.ahead[ann.task] = ahead
        log.warning(
            "%s: task %s: the aggregator announces round %d but this device trained round %d already "
            "(its store is older than this device's state); not answering until a round past %d "
            "(serve --resume-from-devices)",
            self.device,
            ann.task,
            ann.round,
            device_round,
            device_round,
        )
        self.publish_status()

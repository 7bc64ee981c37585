"""A task's state on the device: personal parameters, the last answered round and its upload,
in one atomically written file per task, so a kill at any instant leaves the state before or
after a round and a computed upload is re-sent, never recomputed."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ioft_protocol.state import load_verified, save_arrays
from trainer_lite.params import Params, strip_prefix, with_prefix

UPLOAD = "upload"


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


def save_task_state(path: Path, state: TaskState) -> None:
    """One atomic file per task (``ioft_protocol.state.save_arrays``): a kill leaves the old or the new state."""
    arrays = {**with_prefix(state.local, "local"), **with_prefix(state.upload, UPLOAD)}
    meta = {
        "spec": state.spec_json,
        "answered": list(state.answered) if state.answered else None,
        "upload_meta": state.upload_meta,
        "metrics": state.metrics,
    }
    save_arrays(path, arrays, meta)


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

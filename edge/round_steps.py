"""The steps of one round on the device that need nothing of the daemon but their inputs.

:class:`edge.daemon.EdgeTrainer` answers an announcement as a sequence of named steps: gate
(:func:`check_selected`, :class:`Clients`, :func:`check_width`), state, holdout, pace, resend,
rows, :func:`train`, :func:`kept_state` (encode), :func:`masked_input` (arm SecAgg), persist,
publish (:func:`upload_message`), offer to serving.  A step here has one way to refuse: a check
raises :class:`TaskRefused`, which the daemon reports in its retained status; the others do not
refuse.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge.task_inputs import Rows
from edge.task_state import TaskState
from ioft_protocol.compress import encode_upload
from ioft_protocol.round_messages import Announcement, HoldoutScore, UpdateMessage
from ioft_protocol.secagg import transport as secagg_wire
from trainer_lite.algorithms import ClientAlgorithm, ClientResult, make_client
from trainer_lite.client import participate
from trainer_lite.holdout import holdout_score
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)


class TaskRefused(ValueError):  # noqa: N818 -- a reported refusal, not a program error
    """This device will not take part in a task (reported, not a malformed message)."""


def check_selected(ann: Announcement, device: str, machine_kind: str | None, tags: Sequence[str]) -> None:
    """Raise :class:`TaskRefused` if the task's ``devices`` selection leaves this device out."""
    if ann.devices is None:
        return
    why = ann.devices.refusal(device, machine_kind, tags)
    if why is not None:
        raise TaskRefused(why)


def check_schema(spec: TaskSpec, data_meta: dict) -> None:
    """Raise :class:`TaskRefused` if the task's model takes rows of another feature schema."""
    if spec.feature_schema is None:
        return
    ours = data_meta.get("schema_hash")
    if ours != spec.feature_schema:
        have = f"schema {ours[:12]}" if ours else "no feature schema"
        raise TaskRefused(
            f"built for feature schema {spec.feature_schema[:12]}, but the local data "
            f"({data_meta.get('source', '?')}) has {have}"
        )


def check_width(algo: ClientAlgorithm, rows: Rows | None, data_meta: dict) -> None:
    """Raise :class:`TaskRefused` if the task's model takes another number of input features
    than ``rows`` (what it would train on here) have: a printer task on a welder's 624 features.

    ``rows`` is ``None`` while the task waits for its encoder or has no training rows yet.
    """
    width = algo.input_width()
    if width is None or rows is None:
        return  # a model with no input layer, or nothing to judge yet
    have = rows[0].x.shape[1] if rows[0].x.ndim == 2 else None
    if have != width:
        raise TaskRefused(
            f"the task's model takes {width} input features per row, but the local data "
            f"({data_meta.get('source', '?')}) has {have if have is not None else 'no 2-D rows'}"
        )


class Clients:
    """Each task spec's client update, made once; ``algorithms`` are the ones allowed here (all if empty)."""

    def __init__(self, algorithms: Sequence[str] = ()) -> None:
        self.algorithms = algorithms
        self.by_spec: dict[str, ClientAlgorithm] = {}

    def client(self, spec_json: str, data_meta: dict) -> ClientAlgorithm:
        """The task's client update; :class:`TaskRefused` for an algorithm not allowed here or rows
        of another feature schema (checked each time: edge-recorder may have swapped the rows)."""
        algo = self.by_spec.get(spec_json)
        if algo is not None:
            check_schema(algo.spec, data_meta)
            return algo
        spec = TaskSpec.from_json(spec_json)
        if self.algorithms and spec.algorithm not in self.algorithms:
            raise TaskRefused(f"algorithm {spec.algorithm!r} not allowed on this device ({self.algorithms})")
        check_schema(spec, data_meta)
        algo = self.by_spec[spec_json] = make_client(spec)
        return algo

    def masked(self, spec_json: str) -> bool:
        """Whether the task's update leaves through SecAgg (its upload then carries no parameters)."""
        algo = self.by_spec.get(spec_json)
        if algo is not None:
            return bool(algo.spec.secagg)
        return bool(json.loads(spec_json).get("secagg"))


@dataclass
class Trained:
    """One round's client update: its result, the new personal parameters and the round's metrics."""

    result: ClientResult
    local: Params
    metrics: dict[str, float]
    cpu_s: float


def train(algo: ClientAlgorithm, device: str, ann: Announcement, local: Params, rows: Rows) -> Trained:
    """Run the task's client update on ``rows`` from the announced global and ``local``."""
    train_rows, test_rows, encoder_version = rows
    started, cpu_started = time.perf_counter(), time.process_time()
    result, new_local = participate(
        algo, device, ann.params, local, train_rows, test_rows, round_=ann.round, phase=ann.phase
    )
    metrics = dict(result.metrics) | {"train_seconds": time.perf_counter() - started}
    if encoder_version is not None:
        metrics["encoder_version"] = float(encoder_version)
    return Trained(result, new_local, metrics, time.process_time() - cpu_started)


def bound_to(ann: Announcement, device: str) -> dict[str, Any]:
    """What an encoded update is bound to (its task, round, phase, device and global), so that it
    counts for no other round."""
    return {
        "task": ann.task,
        "round_": ann.round,
        "phase": ann.phase,
        "device": device,
        "global_hash": ann.global_hash,
    }


def kept_state(algo: ClientAlgorithm, device: str, ann: Announcement, trained: Trained) -> TaskState:
    """The task's state after the round, with its upload encoded once: a re-send is the same bytes."""
    compress = algo.spec.compress
    upload = encode_upload(
        trained.result.shared,
        ann.params,
        None if algo.spec.secagg is not None else compress,  # a masked change leaves through SecAgg
        **bound_to(ann, device),
    )
    return TaskState(
        spec_json=ann.spec,
        local=trained.local,
        answered=(ann.round, ann.phase),
        upload=upload,
        upload_meta={"n_samples": trained.result.n_samples, "global_hash": ann.global_hash}
        | ({} if compress is None else {"compress": compress}),
        metrics=trained.metrics,
    )


def upload_message(fleet: str, device: str, task: str, state: TaskState, masked: bool) -> UpdateMessage:
    """The update message of the round ``state`` answered last (a masked task's carries no parameters)."""
    assert state.answered is not None
    round_, phase = state.answered
    return UpdateMessage(
        fleet=fleet,
        task=task,
        device=device,
        round=round_,
        phase=phase,
        n_samples=int(state.upload_meta["n_samples"]),
        global_hash=state.upload_meta["global_hash"],
        metrics=state.metrics,
        params={} if masked else state.upload,
        compress=state.upload_meta.get("compress"),
    )


def masked_input(
    algo: ClientAlgorithm, device: str, ann: Announcement, trained: Trained
) -> tuple[np.ndarray, float]:
    """What a SecAgg task's round masks (the change, or its codes when compressed) and its weight."""
    spec, n = algo.spec, trained.result.n_samples
    update = secagg_wire.secagg_input(
        trained.result.shared,
        ann.params,
        spec.secagg,
        spec.compress,
        **bound_to(ann, device),
    )
    return update, secagg_wire.device_weight(spec.server, n)


def score_global(
    algo: ClientAlgorithm, device: str, ann: Announcement, data: Rows | None
) -> HoldoutScore | None:
    """Held out of the task: the round's global scored on this device's rows
    (``trainer_lite.holdout``); ``None`` (logged) while there are none to score it on."""
    if data is None or len(data[0]) + len(data[1]) == 0:
        log.warning("%s: task %s round %d: nothing to score the global on yet", device, ann.task, ann.round)
        return None
    train, test, _ = data
    metrics = holdout_score(algo, device, ann.params, train, test, phase=ann.phase)
    log.info(
        "%s: task %s round %d %s: held out, the global scores %s",
        device,
        ann.task,
        ann.round,
        ann.phase,
        " ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())),
    )
    return HoldoutScore(ann.round, ann.phase, ann.global_hash, metrics)

"""The device's model of a task trained alone on its own rows: two copies, each kept on disk.

``judged``
    trained on the older rows only (``serving/alone/<task>.safetensors``): the newest rows judge it
    beside the other candidates (:mod:`edge.serving.candidates`), so it must not have seen them;
``every``
    trained on every row of the training split, the newest included
    (``serving/alone/every/<task>.safetensors``): what serves when the judged copy wins.  Serving the
    judged copy itself would throw the newest rows away for good: it stays behind the same model
    trained on every row (``benchmarks.newcomer``'s *alone*), most where a device has few rows.

Both start from the same seeded model, the one ``indiv`` starts this device from
(:func:`trainer_lite.client.seeded_start`: the studies' *alone* is this model), and take the same
steps each round (the task's ``local_steps``, a head's or GLM's cost; a minibatch task's batches drawn as
:func:`trainer_lite.client.participate` draws indiv's, from the fleet's round), so the judged copy stands in
for the one that serves: the same model, minus
the rows that judge it (a cautious stand-in where those rows are a speed the older ones lack:
``benchmarks/results/newcomer_lopo.md``).  Each copy is saved on its own, atomically, and goes on from
its own state: a crash between the two saves leaves them one round's steps apart, nothing worse.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from edge.feed import SERVING_DIR
from ioft_protocol.state import StateError, load_arrays, save_arrays
from trainer_lite.algorithms import ClientAlgorithm, make_client
from trainer_lite.algorithms.base import DEVICE_HPARAMS, TrainConfig
from trainer_lite.client import cast_dataset, derive_rng, seeded_start
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)

ALONE_DIR = "alone"
JUDGED, EVERY = "judged", "every"
_WHAT = {JUDGED: "alone model", EVERY: "alone model on every row"}
_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def alone_spec(spec: TaskSpec) -> TaskSpec:
    """The task as this device alone would train it: ``indiv`` (all parameters local), same model
    and optimizer settings (the hyperparameters only the task's algorithm knows are dropped)."""
    hparams = {k: v for k, v in spec.hparams.items() if k in _TRAIN_FIELDS or k in DEVICE_HPARAMS}
    return dataclasses.replace(spec, algorithm="indiv", hparams=hparams, dp=None, secagg=None, compress=None)


def alone_path(state_dir: Path, task: str, copy: str = JUDGED) -> Path:
    folder = Path(state_dir) / SERVING_DIR / ALONE_DIR
    return (folder if copy == JUDGED else folder / EVERY) / f"{task}.safetensors"


def train_alone(
    state_dir: Path, device: str, task: str, spec: TaskSpec, rows: Dataset, round_: int, copy: str = JUDGED
) -> tuple[ClientAlgorithm, Params]:
    """The ``copy`` of the alone model after the steps of the fleet's round ``round_`` on ``rows``
    (scaled as the task trains), kept on disk.

    It goes on from its saved state when that was trained for the same model; else from its seeded
    start (the same for both copies).
    """
    algo = make_client(alone_spec(spec))
    path = alone_path(state_dir, task, copy)
    params, steps = None, 0
    try:
        got = load_arrays(path)
    except (StateError, ValueError, OSError) as exc:
        log.warning("%s: task %s's %s is unreadable (%s); it starts over", device, task, _WHAT[copy], exc)
        got = None
    if got is not None:
        arrays, meta = got
        fresh = algo.init_local(np.random.default_rng(0))
        same = meta.get("spec") == algo.spec.to_json() and set(arrays) == set(fresh)
        if same and all(np.shape(arrays[n]) == np.shape(fresh[n]) for n in fresh):
            params, steps = copy_params(arrays), int(meta.get("rounds", 0))
    if params is None:  # indiv's start for this device: the model the studies' *alone* trains
        params = seeded_start(algo, device)
    params = {n: np.asarray(v, dtype=spec.dtype) for n, v in params.items()}
    if len(rows):
        rng = derive_rng(spec.seed, device, round_, "train")  # indiv's batches in the simulator's round
        algo.local_steps(params, cast_dataset(rows, spec.dtype), rng, round_=steps + 1)
        steps += 1
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_arrays(path, params, {"spec": algo.spec.to_json(), "rounds": steps})
    except OSError as exc:  # it trains again from its last saved state next round
        log.warning("%s: could not save task %s's %s: %s", device, task, _WHAT[copy], exc)
    return algo, params

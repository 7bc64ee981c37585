"""One device's part in a round, shared by the simulator and the ``edge-trainer`` daemon."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from trainer_lite.algorithms.base import PROGRESS_PREFIX, ClientAlgorithm, ClientResult, algorithm_state
from trainer_lite.data import Dataset
from trainer_lite.params import Params
from trainer_lite.privacy import DPConfig, privatize_upload


def derive_rng(seed: int, *labels: object) -> np.random.Generator:
    """A generator seeded from ``seed`` and labels (device id, round, phase...).

    The same labels give the same stream in any process, so a round rerun after a
    crash draws exactly the same minibatches.
    """
    digest = hashlib.sha256(repr((seed, *labels)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


class LazyRng:
    """:func:`derive_rng`'s generator, made when first drawn from.  Most rounds never draw (full-batch
    steps, the zero-compute ``echo``), and seeding a generator (NumPy's ``SeedSequence``) costs ~20 µs:
    the largest step of a swarm's device-round after its training (``benchmarks/swarm_share.py
    --steps``).  The draws are :func:`derive_rng`'s, bit for bit."""

    __slots__ = ("_labels", "_rng")

    def __init__(self, seed: int, *labels: object) -> None:
        self._labels = (seed, *labels)
        self._rng: np.random.Generator | None = None

    def __getattr__(self, name: str) -> Any:  # only what the slots do not hold: the generator's API
        if self._rng is None:
            self._rng = derive_rng(*self._labels)
        return getattr(self._rng, name)


def cast_params(params: Params, dtype: str) -> Params:
    return {k: np.asarray(v, dtype=dtype) for k, v in params.items()}


def cast_dataset(data: Dataset, dtype: str) -> Dataset:
    y = data.y if data.y.dtype.kind in "iu" else data.y.astype(dtype, copy=False)
    return Dataset(data.x.astype(dtype, copy=False), y, data.domain)


#: Rounds of the task this device has taken part in (its own progress; keys the lr schedule).
ROUNDS_TAKEN = PROGRESS_PREFIX + "rounds"
#: The fleet round it last took part in (the phases of one round count once).
LAST_ROUND = PROGRESS_PREFIX + "last_round"


def seeded_start(algo: ClientAlgorithm, device: str) -> Params:
    """The algorithm's :meth:`~ClientAlgorithm.init_local` for ``device``, seeded by the task seed
    and the device id: the same draw in the simulator, on a device and for its alone model."""
    return algo.init_local(derive_rng(algo.spec.seed, device, "init"))


def initial_local(algo: ClientAlgorithm, device: str) -> Params:
    """A device's first local state (:func:`seeded_start`).

    It holds the algorithm's seeded start and the device's
    progress (no rounds taken yet), which marks the personal state as new: if the
    device's first round is after the fleet's first, :func:`participate` runs the
    algorithm's cold start on it.
    """
    local = seeded_start(algo, device)
    return cast_params({**local, ROUNDS_TAKEN: np.zeros(1), LAST_ROUND: np.zeros(1)}, algo.spec.dtype)


def own_round(local: Params, round_: int) -> tuple[int, bool]:
    """``(the device's own round for fleet round round_, whether its personal state is new)``.

    A local state without progress (saved before it was kept) counts the fleet's round
    and is never new.
    """
    if ROUNDS_TAKEN not in local:
        return round_, False
    taken = int(np.asarray(local[ROUNDS_TAKEN]).reshape(-1)[0])
    last = int(np.asarray(local[LAST_ROUND]).reshape(-1)[0]) if LAST_ROUND in local else 0
    return (taken if last == round_ and taken > 0 else taken + 1), taken == 0


def participate(
    algo: ClientAlgorithm,
    device: str,
    shared: Params,
    local: Params,
    train: Dataset,
    test: Dataset | None,
    *,
    round_: int,
    phase: str,
    noise_rng: np.random.Generator | None = None,
) -> tuple[ClientResult, Params]:
    """Run the client update, then score the personalized model on the local test split.

    Metrics carry ``train_loss`` from the algorithm and ``test_loss`` (personal model,
    local test split) when a test split exists; only scalars leave the device.

    ``round_`` is the fleet's round: it seeds the round's minibatches.  The algorithm is
    given the device's own round (:func:`own_round`) for its learning-rate schedule, and
    a device that joins after the fleet's first round has its new personal state cold
    started from the downlink and its first rows (:meth:`ClientAlgorithm.cold_start`)
    before its first update.  Under
    ``spec.dp`` the shared upload is clipped (and noised, in distributed mode) here, after
    the personal model has been scored: ``trainer_lite.privacy``.  ``noise_rng`` draws that
    noise; ``None`` (a device): fresh OS entropy, so nobody can regenerate it from the seed.
    """
    algo.check_shared(shared, phase)
    dtype = algo.spec.dtype
    train = cast_dataset(train, dtype)
    mine, new = own_round(local, round_)
    local = algorithm_state(local)
    if new and round_ > 1:
        cold_rng = LazyRng(algo.spec.seed, device, "cold-start")
        local = algo.cold_start(shared, local, train, rng=cold_rng, phase=phase)
    rng = LazyRng(algo.spec.seed, device, round_, phase)
    result, new_local = algo.update(shared, local, train, rng=rng, round_=mine, phase=phase)
    metrics = dict(result.metrics)
    if test is not None and len(test):
        metrics.update(
            {f"test_{k}": v for k, v in algo.evaluate(shared, new_local, cast_dataset(test, dtype)).items()}
        )
    shared_out = cast_params(result.shared, dtype)
    dp = DPConfig.from_spec(algo.spec.dp)
    if dp is not None:
        shared_out = privatize_upload(shared, shared_out, dp, noise_rng or np.random.default_rng())
    progress = {ROUNDS_TAKEN: np.array([mine]), LAST_ROUND: np.array([round_])}
    return ClientResult(shared_out, result.n_samples, metrics), cast_params({**new_local, **progress}, dtype)

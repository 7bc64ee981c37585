"""One device's part in a round, shared by the simulator and the ``edge-trainer`` daemon."""

from __future__ import annotations

import hashlib

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult
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


def cast_params(params: Params, dtype: str) -> Params:
    return {k: np.asarray(v, dtype=dtype) for k, v in params.items()}


def cast_dataset(data: Dataset, dtype: str) -> Dataset:
    y = data.y if data.y.dtype.kind in "iu" else data.y.astype(dtype, copy=False)
    return Dataset(data.x.astype(dtype, copy=False), y, data.domain)


def initial_local(algo: ClientAlgorithm, device: str) -> Params:
    """A device's first local state, seeded by the task seed and the device id."""
    return cast_params(algo.init_local(derive_rng(algo.spec.seed, device, "init")), algo.spec.dtype)


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
    local test split) when a test split exists; only scalars leave the device.  Under
    ``spec.dp`` the shared upload is clipped (and noised, in distributed mode) here, after
    the personal model has been scored: ``trainer_lite.privacy``.  ``noise_rng`` draws that
    noise; ``None`` (a device): fresh OS entropy, so nobody can regenerate it from the seed.
    """
    algo.check_shared(shared, phase)
    dtype = algo.spec.dtype
    train = cast_dataset(train, dtype)
    rng = derive_rng(algo.spec.seed, device, round_, phase)
    result, new_local = algo.update(shared, local, train, rng=rng, round_=round_, phase=phase)
    metrics = dict(result.metrics)
    if test is not None and len(test):
        metrics.update(
            {f"test_{k}": v for k, v in algo.evaluate(shared, new_local, cast_dataset(test, dtype)).items()}
        )
    shared_out = cast_params(result.shared, dtype)
    dp = DPConfig.from_spec(algo.spec.dp)
    if dp is not None:
        shared_out = privatize_upload(shared, shared_out, dp, noise_rng or np.random.default_rng())
    return ClientResult(shared_out, result.n_samples, metrics), cast_params(new_local, dtype)

"""A round's generator is seeded only when the round draws from it (``trainer_lite.client.LazyRng``):
seeding costs ~20 µs, most rounds (full-batch steps, ``echo``) never draw, and the draws of one that
does are :func:`~trainer_lite.client.derive_rng`'s bit for bit, so a rerun round takes the same batches."""

from __future__ import annotations

import numpy as np
import pytest

import trainer_lite.client as client
from trainer_lite.algorithms import make_client
from trainer_lite.client import LazyRng, derive_rng, participate
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec


def test_the_lazy_generator_draws_what_derive_rng_draws() -> None:
    lazy, eager = LazyRng(7, "printer3", 12, "train"), derive_rng(7, "printer3", 12, "train")
    np.testing.assert_array_equal(lazy.permutation(50), eager.permutation(50))
    np.testing.assert_array_equal(lazy.integers(0, 10, 8), eager.integers(0, 10, 8))
    np.testing.assert_array_equal(lazy.normal(size=3), eager.normal(size=3))


def _generators_seeded(batch_size: int | None, monkeypatch) -> int:
    seeded = []
    monkeypatch.setattr(client, "derive_rng", lambda *labels: seeded.append(labels) or derive_rng(*labels))
    hparams = {"lr": 0.1, "local_steps": 3} | ({"batch_size": batch_size} if batch_size else {})
    spec = TaskSpec(name="t", algorithm="fedavg", model="mlp", model_args={"sizes": [2, 1]}, hparams=hparams)
    algo = make_client(spec)
    x = np.random.default_rng(0).normal(size=(20, 2))
    data = Dataset(x, x[:, :1] * 0.5)
    shared = algo.init_global(np.random.default_rng(0))
    participate(algo, "d", shared, {}, data, None, round_=1, phase="train")
    return len(seeded)


@pytest.mark.parametrize("batch_size", [None, 4], ids=["full-batch", "minibatch"])
def test_a_round_seeds_its_generator_only_where_it_draws_batches(batch_size, monkeypatch) -> None:
    assert _generators_seeded(batch_size, monkeypatch) == (0 if batch_size is None else 1)

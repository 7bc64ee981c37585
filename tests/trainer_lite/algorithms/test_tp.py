"""Train-then-personalize: FedAvg's upload, plus a fine-tuned copy of the downlink kept at home."""

from __future__ import annotations

import numpy as np

from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.base import loss_and_grads
from trainer_lite.data import Dataset
from trainer_lite.losses import mse
from trainer_lite.task import TaskSpec


def _spec(algorithm: str = "tp", **hp) -> TaskSpec:
    return TaskSpec(name="t", algorithm=algorithm, model="linear", hparams=hp, dtype="float64", rounds=1)


DATA = Dataset(np.linspace(-1, 1, 9)[:, None], np.linspace(0, 3, 9)[:, None])


def test_upload_is_fedavgs_and_the_personal_model_stays_local():
    tp, fedavg = make_client(_spec(finetune_steps=3)), make_client(_spec("fedavg"))
    shared = tp.init_global(np.random.default_rng(0))
    res_tp, local = tp.update(shared, {}, DATA, rng=np.random.default_rng(1), round_=1, phase="train")
    res_fa, _ = fedavg.update(shared, {}, DATA, rng=np.random.default_rng(1), round_=1, phase="train")
    for n in shared:
        np.testing.assert_array_equal(res_tp.shared[n], res_fa.shared[n])
    assert sorted(local) == ["personal.head.bias", "personal.head.weight"]
    assert sorted(res_tp.shared) == ["head.bias", "head.weight"]


def test_fine_tune_starts_from_the_downlinked_global():
    lr = 0.1
    tp = make_client(_spec(optimizer="sgd", lr=lr, finetune_steps=1, finetune_lr=0.3))
    shared = tp.init_global(np.random.default_rng(0))
    _, local = tp.update(shared, {}, DATA, rng=np.random.default_rng(1), round_=1, phase="train")
    _, g = loss_and_grads(tp.model, shared, DATA, mse)
    for n in shared:
        np.testing.assert_allclose(local[f"personal.{n}"], shared[n] - 0.3 * g[n], rtol=1e-12)
    pp = tp.personal_params(shared, local)
    np.testing.assert_allclose(pp["head.bias"], local["personal.head.bias"])


def test_before_finetune_from_the_device_predicts_with_the_global():
    tp = make_client(_spec(finetune_from=5))
    shared = tp.init_global(np.random.default_rng(0))
    _, local = tp.update(shared, {}, DATA, rng=np.random.default_rng(1), round_=4, phase="train")
    assert local == {}
    assert tp.personal_params(shared, local) == shared
    _, local = tp.update(shared, {}, DATA, rng=np.random.default_rng(1), round_=5, phase="train")
    assert local


def test_fine_tuning_fits_the_local_data():
    tp = make_client(_spec(finetune_steps=300, lr=0.05))
    shared = tp.init_global(np.random.default_rng(0))
    _, local = tp.update(shared, {}, DATA, rng=np.random.default_rng(1), round_=1, phase="train")
    assert tp.evaluate(shared, local, DATA)["loss"] < 1e-3
    assert tp.evaluate(shared, {}, DATA)["loss"] > 0.1

"""The FedPP rotated-digits study, quick mode: every run completes, and FedPP leads as the slides say."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import fedpp_digits as study


def test_quick_study_fills_the_table_and_fedpp_beats_local_and_fedavg_without_negative_transfer():
    cfg = study.quick_config()
    results = study.run_study(cfg)
    cells = study.summarise(results)
    n_clients = len(cfg.angles())

    for m in study.METHODS:
        c = cells[("balanced", m)]
        assert len(c["acc"]) == len(cfg.seeds), m
        assert all(0.0 <= v <= 1.0 for v in c["acc"] + c["ptr"]), m
    assert all(len(acc) == n_clients for _, acc, _, _ in results)

    mean = {m: float(np.mean(cells[("balanced", m)]["acc"])) for m in study.METHODS}
    ptr = {m: float(np.mean(cells[("balanced", m)]["ptr"])) for m in study.METHODS}
    # Rotation clusters conflict: one global model is far below training alone (negative transfer)...
    assert mean["FedAvg"] <= mean["LOCAL"] - 0.1, mean
    # ... while propagation among similar clients beats both, with few clients worse off than alone.
    assert mean[study.FEDPP] >= mean["LOCAL"] + 0.02, mean
    assert mean[study.FEDPP] >= mean["FedAvg"] + 0.15, mean
    assert mean[study.FEDPP] >= max(v for m, v in mean.items() if not m.startswith("FedPP")), mean
    assert ptr[study.FEDPP] >= 0.75 and ptr["FedAvg"] <= 0.25, ptr

    body = study.report(cfg, results, seconds=0.0)
    assert "0.8251" in body and "| FedPP " in body


def test_losers_lists_each_seeds_clients_below_local_by_how_much():
    job = study.Job
    results = [
        (job("balanced", "LOCAL", 0), {"a": 0.8, "b": 0.7, "c": 0.5}, [], 0.0),
        (job("balanced", study.FEDPP, 0), {"a": 0.9, "b": 0.65, "c": 0.5}, [], 0.0),  # tie counts as positive
        (job("balanced", "LOCAL", 1), {"a": 0.6, "b": 0.6, "c": 0.6}, [], 0.0),
        (job("balanced", study.FEDPP, 1), {"a": 0.5, "b": 0.7, "c": 0.58}, [], 0.0),
    ]
    got = study.losers(results, "balanced", study.FEDPP)
    assert [s for s, _ in got] == [0, 1]
    assert got[0][1] == {"b": pytest.approx(-0.05)}
    assert got[1][1] == {"a": pytest.approx(-0.1), "c": pytest.approx(-0.02)}
    text = study.losers_table(results, "balanced", ["LOCAL", study.FEDPP])
    assert "b -5.0" in text and "a -10.0, c -2.0" in text


def test_kernel_and_top_k_flags_reach_the_fedpp_rows_and_the_ablations_keep_their_own_w(capsys):
    args = study.build_parser().parse_args(["--kernel", "sum", "--top-k", "none", "--ablations"])
    assert args.kernel == "sum" and args.top_k is study._ALL and args.ablations
    cfg = study.replace(study.Config(), kernel="sum", top_k=None)
    assert study.task_spec(study.FEDPP, cfg, 0).server == {"alpha": 4.0, "top_k": None, "kernel": "sum"}
    default = study.Config()
    assert study.task_spec(study.FEDPP, default, 0).server == {"alpha": 4.0, "top_k": 2, "kernel": "exp"}
    assert study.task_spec(study.FEDPP_SLIDES, default, 0).server == {
        "alpha": 4.0,
        "top_k": None,
        "kernel": "sum",
    }
    assert study.task_spec(study.FEDPP_SUM_TOP2, default, 0).server == {
        "alpha": 4.0,
        "top_k": 2,
        "kernel": "sum",
    }
    argv = [
        "--quick",
        "--no-write",
        "--seeds",
        "0",
        "--rounds",
        "2",
        "--methods",
        "LOCAL",
        "FedPP",
        "--ablations",
    ]
    assert study.main([*argv, "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "top-k 3, kernel 'exp'" in out
    assert "| FedPP (slides' W, dense) |" in out and "| FedPP (Σcos W, top-2)" in out
    assert "clients below LOCAL" in out
    with pytest.raises(SystemExit):
        study.build_parser().parse_args(["--top-k", "0"])


def test_fedpp_trains_on_exactly_locals_images_and_reads_lambda_from_the_validation_images():
    # With a random held-out third of the pooled images FedPP once trained on other images
    # than LOCAL, which alone put single clients several points below LOCAL.
    from trainer_lite.algorithms.fedpp import validation_split

    cfg = study.replace(study.quick_config(), n_test=20)
    seed = 3
    clients, valid = study.make_clients(cfg, "imbalanced", seed, *study.load_images())
    fraction = study.task_spec(study.FEDPP, cfg, seed).hparams["val_fraction"]
    pooled = study.with_validation(clients, valid, seed)
    for device, data in pooled.items():
        train, val = validation_split(data.train, fraction, seed)
        np.testing.assert_array_equal(train.x, clients[device].train.x)
        np.testing.assert_array_equal(train.y, clients[device].train.y)
        np.testing.assert_array_equal(val.x, valid[device].x)
        np.testing.assert_array_equal(val.y, valid[device].y)

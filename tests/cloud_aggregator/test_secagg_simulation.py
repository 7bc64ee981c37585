"""The in-process simulator runs a SecAgg task through the same state machines as the MQTT fleet:
its global is the plain weighted mean up to the fixed-point step, and it learns."""

from __future__ import annotations

import dataclasses

import numpy as np

from cloud_aggregator.rounds.simulation import ClientData, simulate
from ioft_protocol.secagg import SecAggConfig
from tests.cloud_aggregator.test_rounds import SPEC
from trainer_lite.data import Dataset

SECAGG = {"threshold": 0.6, "clip": 4.0, "bits": 20}


def printers(n: int = 4) -> dict[str, ClientData]:
    """Cheap stand-ins for simulated printers: a noisy sigmoid each, shifted per device."""
    rng = np.random.default_rng(0)
    out = {}
    for i in range(n):
        x = rng.uniform(-1, 1, (32, 1))
        y = 1.0 / (1.0 + np.exp(-(2 + 0.3 * i) * x)) + 0.05 * rng.standard_normal((32, 1))
        out[f"printer{i + 1}"] = ClientData(Dataset(x[:24], y[:24]), Dataset(x[24:], y[24:]))
    return out


def test_a_secagg_task_in_the_simulator_matches_the_plain_mean_to_the_step_and_learns():
    masked = dataclasses.replace(SPEC, secagg=SECAGG)
    plain_1, _, _ = simulate(dataclasses.replace(SPEC, rounds=1), printers())
    secagg_1, _, records_1 = simulate(dataclasses.replace(masked, rounds=1), printers())
    step = SECAGG["clip"] / (2 ** (SECAGG["bits"] - 1) - 1)
    for name in plain_1:  # each device's change is rounded to the step: the mean moves by at most step/2
        assert np.abs(secagg_1[name].astype(np.float64) - plain_1[name]).max() <= step / 2 + 1e-6
    assert records_1[0].status == "completed" and len(records_1[0].participants) == 4
    _, _, records = simulate(masked, printers())
    assert records[-1].mean_metric("test_loss") < records[0].mean_metric("test_loss")
    assert SecAggConfig.from_json(masked.secagg).round_params(4, 3).threshold == 3

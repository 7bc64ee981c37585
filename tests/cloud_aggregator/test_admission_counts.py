"""Admission's ``samples`` and ``metrics`` steps: a claimed sample count bounded by the task's cap
and the device's reported rows, metrics finite and bounded; in the pipeline, over the MQTT fleet's
receive path (fake session) and in the in-process simulator, streamed and batch alike."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from cloud_aggregator.config import AdmissionConfig
from cloud_aggregator.rounds.admission import Admission, AdmissionPolicy
from cloud_aggregator.rounds.engine import MemoryStore, RoundEngine
from cloud_aggregator.rounds.simulation import SimulatedFleet
from cloud_aggregator.rounds.types import Reason
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
from ioft_protocol import codec, topics
from ioft_protocol.mqtt_inbound import Message

from .test_admission import (
    DEVICES,
    FLEET,
    TASK,
    FakeSession,
    global_params,
    honest,
    message,
    request,
    run_round,
)
from .test_rounds import SPEC, printers

HUGE = 2**62


def test_sample_count_is_bounded_by_the_cap_and_the_reported_rows():
    g = global_params()
    req = request(1, g)
    rows = {"d1": 10}
    adm = Admission(FLEET, AdmissionPolicy(max_samples=1000), reported_rows=lambda d: rows.get(d))
    claim = lambda d, n: dataclasses.replace(message(req, d, honest(g, d, 1)), n_samples=n)  # noqa: E731
    assert adm.judge("d0", claim("d0", HUGE), req).reason is Reason.N_SAMPLES  # the task's cap
    assert adm.judge("d1", claim("d1", 11), req).reason is Reason.N_SAMPLES  # more than it has
    assert adm.judge("d1", claim("d1", 10), req).n_samples == 10
    assert adm.judge("d2", claim("d2", 1000), req).n_samples == 1000  # no rows reported: the cap alone
    per_task = Admission(FLEET, AdmissionPolicy(task_max_samples={TASK: 5}))
    assert per_task.judge("d3", claim("d3", 6), req).reason is Reason.N_SAMPLES
    assert per_task.judge("d4", claim("d4", 5), req).n_samples == 5


def test_metrics_must_be_finite_few_and_short():
    g = global_params()
    req = request(1, g)
    adm = Admission(FLEET, AdmissionPolicy(max_metrics=4, max_metric_name=8))
    with_metrics = lambda d, m: dataclasses.replace(message(req, d, honest(g, d, 1)), metrics=m)  # noqa: E731
    assert adm.judge("d0", with_metrics("d0", {"loss": math.nan}), req).reason is Reason.NON_FINITE
    assert adm.judge("d1", with_metrics("d1", {"loss": -math.inf}), req).reason is Reason.NON_FINITE
    many = {f"m{i}": 1.0 for i in range(5)}
    assert adm.judge("d2", with_metrics("d2", many), req).reason is Reason.METRICS
    assert adm.judge("d3", with_metrics("d3", {"x" * 9: 1.0}), req).reason is Reason.METRICS
    assert adm.judge("d4", with_metrics("d4", {"loss": 0.5}), req).metrics == {"loss": 0.5}


def test_config_validates_the_bounds():
    assert AdmissionConfig(task_max_samples={"speed": 20}).policy().task_max_samples == {"speed": 20}
    for bad in ({"max_samples": 0}, {"task_max_samples": {"speed": -1}}, {"max_metrics": 0}):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            AdmissionConfig(**bad)


def test_mqtt_fleet_bounds_n_samples_by_the_status_rows(tmp_path):
    session = FakeSession()
    f = MqttFleet(session, FLEET, CollectPolicy(deadline_s=0.2, expected=tuple(DEVICES), max_extensions=0))
    g = global_params()
    req = request(1, g)

    def status(device: str, rows: int) -> Message:
        body = {"device": device, "state": "online", "data": {"train": rows, "test": 2}}
        return Message(topics.topic_status(FLEET, device), json.dumps(body).encode(), True)

    def up(device: str, n: int, metrics: dict | None = None) -> Message:
        msg = dataclasses.replace(
            message(req, device, honest(g, device, 1)), n_samples=n, metrics=metrics or {}
        )
        return Message(topics.topic_up(FLEET, TASK, device), msg.encode(), False)

    msgs = [status(d, 10) for d in DEVICES]
    msgs += [up("d0", HUGE), up("d1", 11), up("d2", 10, {"loss": math.inf})]
    msgs += [up(d, 10) for d in DEVICES[3:]]
    updates, rejected = run_round(f, session, req, msgs)
    assert sorted(updates) == DEVICES[3:]
    assert {d: r.split(":")[0] for d, r in rejected.items()} == {
        "d0": "n_samples",
        "d1": "n_samples",
        "d2": "non_finite",
    }


@pytest.mark.parametrize("streamed", [True, False])
def test_simulator_refuses_a_forged_sample_count_streamed_and_batch(streamed):
    """A device claiming 2^62 samples (or NaN metrics) is refused; the round's mean is the others'."""
    spec = dataclasses.replace(SPEC, server={"weighting": "samples"}, rounds=2)

    def forge(req, sent):
        out = []
        for device, msg in sent:
            if device == "printer1":
                msg = dataclasses.replace(msg, n_samples=HUGE)
            elif device == "printer2":
                msg = dataclasses.replace(msg, metrics={**msg.metrics, "train_loss": math.nan})
            out.append((device, msg))
        return out

    def without_attackers(req, sent):
        return [(d, m) for d, m in sent if d not in ("printer1", "printer2")]

    def run(uplinks):
        engine = RoundEngine(spec, SimulatedFleet(spec, printers(4), uplinks=uplinks), store=MemoryStore())
        if not streamed:
            engine.strategy.fold = lambda phase: None
        records = []
        engine.on_record = records.append
        return engine.run(), records

    forged, records = run(forge)
    honest_only, _ = run(without_attackers)
    for rec in records:
        assert rec.rejected["printer1"].startswith("n_samples")
        assert rec.rejected["printer2"].startswith("non_finite")
        assert all(math.isfinite(v) for m in rec.metrics.values() for v in m.values())
    for name in honest_only:
        np.testing.assert_array_equal(forged[name], honest_only[name])


def test_an_integer_metric_beyond_float_range_is_malformed():
    g = global_params()
    req = request(1, g)
    msg = message(req, "d0", g)
    fields = {
        k: getattr(msg, k) for k in ("fleet", "task", "device", "round", "phase", "n_samples", "global_hash")
    }
    payload = codec.encode("update", {**fields, "metrics": {"x": 10**400}}, msg.params)
    refusal = Admission(FLEET).judge("d0", payload, req)
    assert refusal.reason is Reason.MALFORMED and "too large" in refusal.detail

"""FedBuff's buffer (staleness weights, apply every K, too-stale uploads dropped) and the
buffered server's admission of every arrival."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_aggregator.aggregation.fedbuff import Arrival, BufferConfig, UpdateBuffer, staleness_weight
from cloud_aggregator.rounds.buffered import BufferedServer
from cloud_aggregator.rounds.types import Reason, Refusal
from ioft_protocol.round_messages import UpdateMessage
from tests.budget import examples
from trainer_lite.task import TaskSpec

G0 = {"w": np.array([1.0, -2.0, 0.5], dtype=np.float32), "b": np.array([0.25], dtype=np.float32)}
SPEC = TaskSpec(
    "speed", "pflda", "sigmoid_glm", hparams={"lr": 0.1, "local_steps": 5}, server={"weighting": "uniform"}
)


def shifted(base: dict[str, np.ndarray], by: float) -> dict[str, np.ndarray]:
    return {n: (v + by).astype(v.dtype) for n, v in base.items()}


@given(st.integers(0, 10**6))
@settings(max_examples=examples(50), deadline=None)
def test_sqrt_staleness_is_the_papers_and_decreasing(tau: int) -> None:
    s = staleness_weight(tau)
    assert s == 1.0 / math.sqrt(1.0 + tau)
    assert 0.0 < staleness_weight(tau + 1) < s <= 1.0
    assert staleness_weight(tau, "constant") == 1.0


def test_staleness_weight_refuses_bad_input() -> None:
    assert staleness_weight(0) == 1.0 and staleness_weight(3) == 0.5
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1)
    with pytest.raises(ValueError, match="one of"):
        staleness_weight(1, "linear")


@given(
    k=st.integers(1, 6),
    lr=st.sampled_from([0.25, 1.0, 2.0]),
    steps=st.lists(st.tuples(st.floats(-4, 4, allow_nan=False), st.integers(0, 3)), max_size=20),
)
@settings(max_examples=examples(60), deadline=None)
def test_global_moves_every_k_arrivals_by_the_weighted_mean_delta(k: int, lr: float, steps) -> None:
    buf = UpdateBuffer(G0, BufferConfig(k=k, server_lr=lr))
    versions = [buf.global_params]
    pending: list[tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]] = []
    for i, (shift, back) in enumerate(steps, 1):
        base_version = max(0, buf.version - back)
        base = versions[base_version]
        upload = shifted(base, shift)
        before = buf.global_params
        arrival = buf.add(upload, base, base_version)
        assert arrival.staleness == (buf.version - (1 if arrival.applied else 0)) - base_version
        assert arrival.weight == staleness_weight(arrival.staleness) and not arrival.dropped
        pending.append((arrival.weight, upload, base))
        assert arrival.applied == (i % k == 0)
        assert buf.version == i // k
        if not arrival.applied:
            assert buf.global_params is before  # nothing moves between applications
            continue
        for name, value in before.items():  # g + η/K Σ s(τ)·(θ − base), in float64, cast once
            total = sum(
                w * (up[name].astype(np.float64) - b[name].astype(np.float64)) for w, up, b in pending
            )
            want = (value.astype(np.float64) + lr / k * total).astype(np.float32)
            np.testing.assert_array_equal(buf.global_params[name], want)
        pending = []
        versions.append(buf.global_params)
    assert buf.count == len(steps) % k


def test_k_equal_to_the_fleet_without_staleness_is_the_uniform_mean() -> None:
    uploads = [shifted(G0, s) for s in (0.5, -1.0, 2.0, 0.125)]
    buf = UpdateBuffer(G0, BufferConfig(k=len(uploads)))
    for up in uploads:
        buf.add(up, G0, 0)
    for name in G0:
        mean = np.mean([u[name].astype(np.float64) for u in uploads], axis=0)
        np.testing.assert_allclose(buf.global_params[name], mean, rtol=1e-6)
    assert G0["w"][0] == 1.0  # the caller's arrays untouched


@given(max_staleness=st.integers(0, 4), back=st.integers(0, 8))
@settings(max_examples=examples(40), deadline=None)
def test_uploads_staler_than_max_staleness_are_dropped(max_staleness: int, back: int) -> None:
    buf = UpdateBuffer(G0, BufferConfig(k=1, max_staleness=max_staleness))
    versions = [buf.global_params]
    for _ in range(8):  # eight server updates: versions 0..8
        buf.add(shifted(buf.global_params, 0.1), buf.global_params, buf.version)
        versions.append(buf.global_params)
    before, version = buf.global_params, buf.version
    base_version = version - back
    arrival = buf.add(shifted(versions[base_version], 1.0), versions[base_version], base_version)
    assert arrival.staleness == back
    if back > max_staleness:
        assert arrival.dropped and arrival.weight == 0.0 and not arrival.applied
        assert buf.global_params is before and buf.version == version and buf.dropped == 1
    else:
        assert not arrival.dropped and arrival.applied and buf.version == version + 1


def test_a_bad_upload_leaves_the_buffer_as_it_was() -> None:
    buf = UpdateBuffer(G0, BufferConfig(k=2))
    buf.add(shifted(G0, 1.0), G0, 0)
    with pytest.raises(ValueError, match="lacks 'b'"):
        buf.add({"w": G0["w"]}, G0, 0)
    with pytest.raises(ValueError, match="shape"):
        buf.add({**G0, "w": np.zeros(4, np.float32)}, G0, 0)
    with pytest.raises(ValueError, match="differ"):
        buf.add({**G0, "extra": np.zeros(1, np.float32)}, G0, 0)
    with pytest.raises(ValueError, match="base version 1"):
        buf.add(G0, G0, 1)
    assert buf.count == 1 and buf.version == 0
    assert buf.add(shifted(G0, 1.0), G0, 0).applied
    np.testing.assert_allclose(buf.global_params["w"], G0["w"] + 1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k": 0}, "buffer_k"),
        ({"server_lr": 0.0}, "server_lr"),
        ({"server_lr": math.inf}, "server_lr"),
        ({"staleness": "poly"}, "staleness must be one of"),
        ({"max_staleness": -1}, "max_staleness"),
    ],
)
def test_config_names_the_bad_field(kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BufferConfig(**kwargs)


# -- the buffered server: jobs and admission ------------------------------------------------


def upload(server: BufferedServer, device: str, shift: float, **fields) -> UpdateMessage:
    job = server.jobs[device]
    msg = dict(
        fleet="sim",
        task=SPEC.name,
        device=device,
        round=job.round,
        phase=server.phase,
        n_samples=10,
        global_hash=job.global_hash,
        metrics={},
        params=shifted(job.params, shift),
    )
    return UpdateMessage(**(msg | fields))


def test_every_arrival_passes_admission_and_the_ledger_adds_up() -> None:
    server = BufferedServer(SPEC, BufferConfig(k=2))
    for d in ("a", "b", "c"):
        server.dispatch(d)
    first = upload(server, "a", 0.1)
    assert isinstance(server.receive("a", first), Arrival)
    again = server.receive("a", first)  # a QoS 1 copy: no job open for it any more
    assert isinstance(again, Refusal) and again.reason == Reason.NO_ROUND
    forged = server.receive("b", upload(server, "c", 0.1))
    assert isinstance(forged, Refusal) and forged.reason == Reason.IMPERSONATION
    old = upload(server, "b", 0.1, round=server.jobs["b"].round - 1)
    assert server.receive("b", old).reason == Reason.STALE_ROUND
    bad = upload(server, "b", 0.1, params={"decoder.weight": np.zeros((2, 2), np.float32)})
    assert server.receive("b", bad).reason == Reason.SHAPE_DTYPE
    applied = server.receive("b", upload(server, "b", 0.3))
    assert isinstance(applied, Arrival) and applied.applied and server.version == 1
    server.dispatch("a")  # new work from version 1; c still trains from version 0
    from_c = upload(server, "c", 0.0)
    server.abandon("c")  # c left: the update it was computing never counts
    assert server.receive("c", from_c).reason == Reason.NO_ROUND
    arrival = server.receive("a", upload(server, "a", 0.2))
    assert isinstance(arrival, Arrival) and arrival.staleness == 0 and arrival.version == 1
    led = server.ledger()
    assert led["arrived"] == led["buffered"] + led["too_stale"] + led["refused"]
    assert led["dispatched"] == led["buffered"] + led["too_stale"] + led["abandoned"] + led["outstanding"]
    assert (led["buffered"], led["refused"], led["abandoned"], led["applied"]) == (3, 5, 1, 1)


def test_a_stale_job_is_weighted_by_its_staleness() -> None:
    server = BufferedServer(SPEC, BufferConfig(k=1))
    server.dispatch("slow")
    for _ in range(3):
        server.dispatch("fast")
        server.receive("fast", upload(server, "fast", 0.01))
    arrival = server.receive("slow", upload(server, "slow", 0.01))
    assert (arrival.staleness, arrival.weight) == (3, 0.5)
    assert server.version == 4 and not server._versions.keys() - {4}  # old versions let go


def test_an_algorithm_without_a_mean_server_is_refused() -> None:
    spec = TaskSpec(
        "pca", "perpca", "perpca", hparams={"dim": 6, "r_global": 2, "r_local": 1}, dtype="float64"
    )
    with pytest.raises(ValueError, match="weighted mean"):
        BufferedServer(spec)

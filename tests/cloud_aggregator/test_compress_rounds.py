"""`[task.compress]`: validated at start-up (refused in one line where it cannot compose), decoded
by admission against what the device was sent, and run end to end by the simulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.rounds.admission import Admission, Reason, Refusal
from cloud_aggregator.rounds.engine import CollectRequest
from cloud_aggregator.rounds.simulation import ClientData, mean_test_loss, simulate
from cloud_aggregator.rounds.task_rules import compress_refusal
from ioft_protocol import codec, compress
from ioft_protocol.config import ConfigError, build
from ioft_protocol.round_messages import UpdateMessage
from trainer_lite.data import Dataset
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

MLP = {"name": "w", "algorithm": "fedavg", "model": "mlp", "model_args": {"sizes": [8, 16, 2]}}


def _config(task: dict, **top) -> AggregatorConfig:
    return build(AggregatorConfig, {"fleet": "f", "allow_plaintext": True, **top, "task": [task]}, "test")


def test_the_table_reaches_the_spec_devices_get():
    (task,) = _config({**MLP, "compress": {"bits": 2}}).task
    assert task.compress == compress.CompressConfig(bits=2)
    spec = TaskSpec.from_json(task.spec().to_json())
    assert spec.compress == {"bits": 2, "rotation": True, "block": 1024}
    assert "compress" not in TaskSpec("t", "fedavg", "mlp").to_json()  # specs without it are unchanged


@pytest.mark.parametrize(
    ("change", "top", "why"),
    [
        ({"compress": {"bits": 3}}, {}, "bits must be one of"),
        ({"secagg": {"clip": 1.0}}, {}, r"\[task.secagg\] sums codes on one grid.*weighting = 'uniform'"),
        (
            {
                "secagg": {"clip": 1.0},
                "server": {"weighting": "uniform"},
                "dp": {"mode": "distributed", "devices_per_round": 4},
            },
            {},
            r"\[task.secagg\] with \[task.dp\] sums quantized shares of the noise",
        ),
        ({"server": {"reducer": "median"}}, {}, "not a streaming mean"),
        ({"mode": "buffered"}, {}, "mode = 'buffered'"),
        (
            {},
            {"collect": {"straggler": "next_round"}},
            r"\[task.compress\] needs \[collect\] straggler = 'drop'",
        ),
    ],
)
def test_tasks_compression_cannot_serve_are_refused_naming_the_fix(change, top, why):
    task = {**MLP, "compress": {"bits": 1}, **change}
    with pytest.raises((ValueError, ConfigError), match=why):
        _config(task, **top)


@pytest.mark.parametrize(
    ("change", "top"),
    [
        ({"secagg": {"clip": 1.0}, "server": {"weighting": "uniform"}}, {}),
        ({"dp": {"mode": "central", "devices_per_round": 4}}, {}),
        ({"dp": {"mode": "distributed", "devices_per_round": 4}}, {}),
        ({}, {"collect": {"workers": 2}}),
    ],
)
def test_compression_composes_with_secagg_dp_and_workers(change, top):
    (task,) = _config({**MLP, "compress": {"bits": 1}, **change}, **top).task
    assert task.compress == compress.CompressConfig(bits=1)


def _request(spec: TaskSpec, g: dict[str, np.ndarray]) -> CollectRequest:
    return CollectRequest(
        spec=spec,
        round=1,
        phase="train",
        global_params=g,
        global_hash=param_hash(g),
        downlinks={},
        expected={n: codec.TensorSpec(tuple(v.shape), v.dtype.name) for n, v in g.items()},
    )


def test_admission_decodes_what_the_device_encoded_and_refuses_the_wrong_form():
    how = {"bits": 1}
    spec = TaskSpec("t", "fedavg", "mlp", compress=how)
    rng = np.random.default_rng(0)
    g = {"w": rng.standard_normal((8, 16)).astype(np.float32), "b": np.zeros(16, np.float32)}
    u = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in g.items()}
    req = _request(spec, g)
    codes = compress.encode_upload(
        u, g, how, task="t", round_=1, phase="train", device="d1", global_hash=req.global_hash
    )
    msg = UpdateMessage("f", "t", "d1", 1, "train", 10, req.global_hash, {}, codes, how)
    admission = Admission("f")
    verdict = admission.judge("d1", msg.encode(), req)
    seed = compress.derive_seed("t", 1, "train", "d1", req.global_hash)
    want = compress.decode(codes, g, {"w": "float32", "b": "float32"}, compress.CompressConfig(), seed)
    assert not isinstance(verdict, Refusal), verdict
    assert param_hash(verdict.params) == param_hash(want)

    plain = dataclasses.replace(msg, device="d2", params=u, compress=None)
    assert admission.judge("d2", plain.encode(), req).reason is Reason.MALFORMED
    short = dataclasses.replace(
        msg, device="d3", params={**codes, compress.CODES: codes[compress.CODES][:-1]}
    )
    refusal = admission.judge("d3", short.encode(), req)
    assert refusal.reason is Reason.MALFORMED and "compress.codes" in refusal.detail
    # A task without compression refuses codes.
    assert (
        admission.judge("d1", msg.encode(), _request(TaskSpec("t", "fedavg", "mlp"), g)).reason
        is Reason.MALFORMED
    )


def _clients() -> dict[str, ClientData]:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 2))
    out = {}
    for i in range(4):
        x = rng.standard_normal((60, 8))
        y = x @ w + 0.3 * rng.standard_normal((60, 2))
        out[f"d{i}"] = ClientData(Dataset(x, y), Dataset(x[:20], y[:20]))
    return out


def test_a_compressed_task_trains_in_the_simulator_close_to_float32():
    base = {**MLP, "hparams": {"lr": 0.1, "local_steps": 5}, "rounds": 1, "seed": 2}
    plain, fleet, _ = simulate(TaskSpec(**base), _clients())
    packed, packed_fleet, records = simulate(TaskSpec(**base, compress={"bits": 8}), _clients())
    assert [r.status for r in records] == ["completed"]
    assert param_hash(plain) != param_hash(packed)  # the uploads were compressed ...
    gap = np.sqrt(sum(np.sum((packed[n] - plain[n]) ** 2) for n in plain))
    assert gap < 0.05  # ... and 8 bits lose little (measured 0.017; plain training is chaotic later)
    assert mean_test_loss(packed_fleet, packed) == pytest.approx(mean_test_loss(fleet, plain), rel=0.05)


def test_central_dp_clips_the_decoded_change_so_its_noise_covers_the_quantized_update():
    """A 1-bit upload decodes to a change longer than the one the device clipped (EDEN's unbiasing
    scale makes ‖x̂‖ ≥ ‖x‖), so the aggregator clips what it decoded: the clip the noise is
    calibrated on bounds the quantized update, whatever the quantization added."""
    clip = 0.05
    dp = {"mode": "central", "clip": clip, "noise_multiplier": 1e-9, "devices_per_round": 1}
    base = {**MLP, "hparams": {"lr": 0.5, "local_steps": 5}, "rounds": 1, "seed": 2}
    spec = TaskSpec(**base, compress={"bits": 1}, dp=dp)
    seen: list[float] = []
    initial: dict[str, np.ndarray] = {}
    judge = Admission.judge

    def spy(self, device, payload, request, **kw):  # the decoded change of every upload admitted
        verdict = judge(self, device, payload, request, **kw)
        if not isinstance(verdict, Refusal):
            g = initial.setdefault("g", request.global_params)
            seen.append(float(np.sqrt(sum(np.sum((verdict.params[n] - g[n]) ** 2.0) for n in g))))
        return verdict

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Admission, "judge", spy)
        final, _, records = simulate(spec, {"d0": _clients()["d0"]})  # one device: the mean is its change
    assert records[0].status == "completed" and len(seen) == 1
    assert max(seen) > clip * 1.01  # quantization lengthened the device-clipped change ...
    g = initial["g"]
    moved = np.sqrt(sum(np.sum((final[n].astype(np.float64) - g[n]) ** 2) for n in final))
    assert moved <= clip * (1 + 1e-5)  # ... and the aggregator's clip held it to the clip


def test_feddar_compresses_its_changes_and_sends_counts_and_curvatures_uncoded():
    """FedDAR's server takes means of decoded uploads (``Strategy.compressible``): its heads and
    encoder go as codes, its counts and curvatures (not changes of anything sent) as they are."""
    rng = np.random.default_rng(0)
    b, w = rng.standard_normal((6, 2)), rng.standard_normal((3, 2))
    clients = {}
    for i in range(6):
        z = rng.integers(0, 3, 12)
        x = rng.standard_normal((12, 6))
        y = np.einsum("nd,dk,nk->n", x, b, w[z])[:, None]
        clients[f"c{i}"] = ClientData(Dataset(x, y, z))
    hp = {"optimizer": "sgd", "lr": 0.1, "local_steps": 1, "head_steps": 2, "head_lr": 0.1, "n_domains": 3}
    common = {"model": "linear_rep", "model_args": {"d_in": 6, "k": 2, "d_out": 1}, "dtype": "float64"}
    plain = TaskSpec("dar", "feddar", hparams={**hp, "aggregation": "sa"}, rounds=3, **common)
    packed = dataclasses.replace(plain, compress={"bits": 8})
    assert compress_refusal(packed) is None
    alg2 = TaskSpec("dar", "feddar_linear", hparams={"n_domains": 3}, compress={"bits": 8}, **common)
    assert "not a streaming mean" in compress_refusal(alg2)
    want, _, _ = simulate(plain, clients)
    got, _, records = simulate(packed, clients)
    assert all(len(r.participants) == 6 and not r.rejected for r in records)
    for name in want:  # 8 bits: close to float32's model, not equal to it
        assert np.abs(got[name] - want[name]).max() < 0.02
    assert param_hash(got) != param_hash(want)

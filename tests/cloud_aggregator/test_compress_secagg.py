"""`[task.compress]` with `[task.secagg]`: the masked ring carries each device's integer codes (the
round's shared rotation and grid), and the SecAgg sum is exactly the sum of the codes in the clear,
so the global equals the unmasked compressed mean bit for bit, dropouts included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cloud_aggregator.rounds.engine import CollectRequest
from cloud_aggregator.rounds.secagg import apply_mean, ring_codes, ring_length
from cloud_aggregator.rounds.simulation import mean_test_loss as fleet_loss
from cloud_aggregator.rounds.simulation import simulate
from ioft_protocol import codec, compress
from ioft_protocol.secagg import SecAggConfig
from ioft_protocol.secagg.simulate import run_round
from ioft_protocol.secagg.transport import flatten, secagg_input, unflatten
from tests.cloud_aggregator.test_rounds import SPEC
from tests.cloud_aggregator.test_secagg_simulation import printers
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

SECAGG = {"threshold": 0.6, "clip": 0.05}
UNIFORM = {"weighting": "uniform"}


def _request(spec: TaskSpec, g: dict[str, np.ndarray]) -> CollectRequest:
    return CollectRequest(
        spec=spec,
        round=3,
        phase="train",
        global_params=g,
        global_hash=param_hash(g),
        downlinks={},
        expected={n: codec.TensorSpec(tuple(v.shape), v.dtype.name) for n, v in g.items()},
    )


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_the_masked_sum_of_codes_is_the_clear_sum_and_decodes_to_the_same_global(bits):
    spec = TaskSpec("t", "fedavg", "mlp", server=UNIFORM, secagg=SECAGG, compress={"bits": bits, "block": 64})
    rng = np.random.default_rng(bits)
    g = {"w": rng.standard_normal((9, 11)).astype(np.float32), "b": np.zeros(11, np.float32)}
    request = _request(spec, g)
    devices = [f"d{i}" for i in range(6)]
    codes = {
        d: secagg_input(
            {n: v + 0.02 * rng.standard_normal(v.shape).astype(np.float32) for n, v in g.items()},
            g,
            SECAGG,
            spec.compress,
            task="t",
            round_=3,
            phase="train",
            device=d,
            global_hash=request.global_hash,
        )
        for d in devices
    }
    assert ring_length(request) == 128 and all(c.shape == (128,) for c in codes.values())
    assert max(int(c.max()) for c in codes.values()) <= 2**bits - 1

    run = run_round(
        SecAggConfig(**SECAGG),
        codes,
        dict.fromkeys(devices, 1.0),
        drop={"masked": {"d2"}},
        codes=ring_codes(request),
    )
    survivors = [d for d in devices if d != "d2"]
    assert run.outcome.survivors == tuple(survivors)
    clear = np.sum([codes[d].astype(np.int64) for d in survivors], axis=0)
    assert np.array_equal(run.outcome.total, clear.astype(np.float64)) and run.outcome.weight == len(
        survivors
    )
    assert run.server.params.ring_bits == bits + 3  # 6 devices: bits + ceil(log2 6), not 16 + 3

    masked = apply_mean(g, run.outcome, request)
    seed = compress.shared_seed("t", 3, "train", request.global_hash)
    cfg = compress.CompressConfig(bits=bits, block=64)
    unmasked = unflatten(flatten(g) + compress.decode_ring(clear, len(survivors), cfg, 0.05, seed, 110), g)
    assert param_hash(masked) == param_hash(unmasked)


def test_the_shared_grid_is_an_unbiased_estimate_of_the_mean_change_within_the_clip():
    cfg = compress.CompressConfig(bits=1, block=256)
    rng = np.random.default_rng(0)
    x = 0.01 * rng.standard_normal(200)
    total = np.zeros(256)
    draws = 4000
    for i in range(draws):  # one device, many dithers: the codes' mean decodes to x
        total += compress.encode_ring(x, cfg, 0.05, seed=7, dither=i)
    mean = compress.decode_ring(total, draws, cfg, 0.05, 7, 200)
    # 1 bit over ±0.05 has a standard deviation ≤ 0.05 per draw: ≤ 0.05/√4000 ≈ 8e-4 on the mean
    assert np.abs(mean - x).max() < 5 * 0.05 / np.sqrt(draws)


def test_a_compressed_secagg_task_trains_in_the_simulator_near_its_uncompressed_twin():
    # the clip bounds each *rotated* coordinate: (a ± b)/√2 for this 2-parameter model
    masked = dataclasses.replace(SPEC, server=UNIFORM, secagg={"threshold": 0.6, "clip": 2.0})
    packed = dataclasses.replace(masked, compress={"bits": 8})
    plain, plain_fleet, _ = simulate(masked, printers())
    got, fleet, records = simulate(packed, printers())
    assert all(r.status == "completed" and len(r.participants) == 4 for r in records)
    assert param_hash(got) != param_hash(plain)  # the codes, not the fixed-point floats, were summed
    assert records[-1].mean_metric("test_loss") < records[0].mean_metric("test_loss")
    assert fleet_loss(fleet, got) == pytest.approx(fleet_loss(plain_fleet, plain), rel=0.05)


def test_round_params_carry_codes_only_when_the_ring_holds_them():
    from ioft_protocol.secagg.config import RoundParams

    cfg = SecAggConfig(**SECAGG)
    plain, coded = cfg.round_params(20, 100), cfg.round_params(20, 128, codes=1)
    assert "codes" not in plain.to_json()  # a fixed-point round's setup is as before
    assert (plain.ring_bits, coded.ring_bits) == (16 + 5, 1 + 5)
    assert RoundParams.from_json(coded.to_json()) == coded
    with pytest.raises(ValueError, match="codes must be 0, 1, 2, 4 or 8"):
        RoundParams.from_json({**coded.to_json(), "codes": 3})

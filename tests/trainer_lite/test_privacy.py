"""DP-FedAvg's shared arithmetic (``trainer_lite.privacy``): the clip bound, the noise scales, the spec."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tests.budget import examples
from trainer_lite.privacy import DPConfig, l2_norm, noisy_mean, privatize_upload
from trainer_lite.task import TaskSpec

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)


@settings(max_examples=examples(60), deadline=None)
@given(
    ref=arrays(np.float64, st.integers(1, 20), elements=finite),
    scale=st.floats(1e-6, 1e3),
    clip=st.floats(1e-3, 1e2),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_clipped_change_never_exceeds_c_and_a_small_one_passes_unchanged(ref, scale, clip, seed):
    rng = np.random.default_rng(seed)
    upload = {"w": ref + scale * rng.standard_normal(ref.shape), "b": rng.standard_normal(3)}
    reference = {"w": ref, "b": np.zeros(3)}
    cfg = DPConfig(clip=clip)
    out = privatize_upload(reference, upload, cfg, rng)
    change = {n: out[n] - reference[n] for n in out}
    norm_before = l2_norm({n: upload[n] - reference[n] for n in upload})
    # The rounding of g + Δ in float64 is all that may exceed the bound.
    tol = 1e-9 * (1 + max(float(np.max(np.abs(ref))), 1.0))
    assert l2_norm(change) <= clip + tol * math.sqrt(ref.size + 3)
    if norm_before <= clip:
        np.testing.assert_allclose(out["w"], upload["w"], rtol=0, atol=tol)


def test_the_clip_is_joint_over_every_tensor_and_keeps_the_direction():
    ref = {"a": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)}
    upload = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([4.0], np.float32)}  # ‖Δ‖ = 5
    out = privatize_upload(ref, upload, DPConfig(clip=1.0), np.random.default_rng(0))
    np.testing.assert_allclose(out["a"], [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out["b"], [0.8], rtol=1e-6)
    assert out["a"].dtype == np.float32  # the upload's dtype


def test_a_devices_distributed_share_has_variance_sigma_squared_over_n():
    cfg = DPConfig(mode="distributed", clip=2.0, noise_multiplier=1.1, devices_per_round=4)
    ref = {"w": np.zeros(200_000)}
    out = privatize_upload(ref, ref, cfg, np.random.default_rng(7))  # no change: the noise alone
    expected = 1.1 * 2.0 / math.sqrt(4)
    assert abs(float(np.std(out["w"])) / expected - 1) < 0.01
    assert abs(float(np.mean(out["w"]))) < 4 * expected / math.sqrt(200_000)
    # n shares sum to the full noise σ = z·C.
    shares = [privatize_upload(ref, ref, cfg, np.random.default_rng(s))["w"] for s in range(4)]
    assert abs(float(np.std(np.sum(shares, axis=0))) / (1.1 * 2.0) - 1) < 0.01


def test_central_noise_on_the_sum_is_z_times_c_and_the_denominator_is_fixed():
    ref = {"w": np.ones(100_000)}
    uploads = [{"w": ref["w"] + 0.001}] * 3  # three devices, each a tiny change
    out = noisy_mean(ref, uploads, denominator=10, noise_std=1.5, rng=np.random.default_rng(3), clip=1.0)
    noise_on_sum = (out["w"] - ref["w"]) * 10 - 3 * 0.001
    assert abs(float(np.std(noise_on_sum)) / 1.5 - 1) < 0.01
    # Without noise: the change summed over the 3 that came, divided by the 10 expected.
    plain = noisy_mean(ref, uploads, denominator=10, noise_std=0.0, rng=np.random.default_rng(0))
    np.testing.assert_allclose(plain["w"], 1 + 0.0003, rtol=1e-12)


def test_the_server_reclips_in_central_mode():
    ref = {"w": np.zeros(4)}
    out = noisy_mean(
        ref, [{"w": np.full(4, 10.0)}], denominator=1, noise_std=0, rng=np.random.default_rng(0), clip=1.0
    )
    assert l2_norm(out) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"mode": "local"}, "dp mode must be one of"),
        ({"clip": 0.0}, "clip must be a finite number > 0"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be"),
        ({"delta": 1.0}, "delta must lie in (0, 1)"),
        ({"epsilon_budget": 0.0}, "epsilon_budget must be > 0"),
        ({"devices_per_round": 0}, "devices_per_round must be an integer >= 1"),
        ({"fleet_size": 10}, "fleet_size needs devices_per_round"),
        ({"devices_per_round": 5, "fleet_size": 4}, "is below devices_per_round"),
        ({"mode": "distributed"}, "needs devices_per_round"),
    ],
)
def test_a_bad_dp_table_is_refused_naming_the_field(fields, needle):
    with pytest.raises(ValueError) as info:
        DPConfig(**fields)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_the_spec_carries_dp_and_leaves_it_out_when_off():
    cfg = DPConfig(mode="distributed", devices_per_round=3, fleet_size=30, epsilon_budget=8.0)
    spec = TaskSpec("t", "fedavg", "sigmoid_glm", dp=cfg.to_spec())
    again = TaskSpec.from_json(spec.to_json())
    assert DPConfig.from_spec(again.dp) == cfg
    assert cfg.sampling_rate() == pytest.approx(0.1)
    assert '"dp"' not in TaskSpec("t", "fedavg", "sigmoid_glm").to_json()  # old specs keep their form
    with pytest.raises(ValueError, match="unknown dp fields"):
        TaskSpec("t", "fedavg", "sigmoid_glm", dp={"clip": 1.0, "sigma": 2})

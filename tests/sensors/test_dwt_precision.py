"""The default feature path (float32 transform where its error estimate allows) against float64.

The contract is :mod:`sensors.features.precision`'s: every feature within
``FEATURE_RTOL * (|float64| + scale)`` of the float64 value (zero crossings also within a
few crossings); channels with silent bands take the float64 path and match it exactly.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest
import pywt
from hypothesis import given, settings
from hypothesis import strategies as st

from sensors.features import DEFAULT_SCHEMA, FeatureSchema, extract_batch, extract_features
from sensors.features.precision import tolerance_used
from sensors.features.reference import extract_features_reference
from sensors.sim.welder import WeldCondition, simulate_weld
from sensors.welding import WeldRecording
from tests.budget import examples
from tests.sensors.test_dwt_features import property_signals
from tests.sensors.test_dwt_reference import signals

FS = 200_000.0
CH = ("power", "lvdt", "ae", "mic")


def band_lengths(n: int, schema: FeatureSchema) -> np.ndarray:
    coeffs = pywt.wavedec(np.zeros(n), schema.wavelet, mode=schema.mode, level=schema.level)
    return np.array([len(c) for c in coeffs])


def assert_within_tolerance(fast: np.ndarray, exact: np.ndarray, n: int, schema: FeatureSchema) -> None:
    """``fast`` and ``exact`` are feature rows (..., n_features) of the default 12 statistics."""
    nb = len(schema.bands)
    f = fast.reshape(*fast.shape[:-1], -1, nb, 12)
    used = tolerance_used(f, exact.reshape(f.shape), band_lengths(n, schema))
    names = np.array(schema.feature_names()).reshape(-1, nb, 12)
    where = np.argwhere(used > 1.0)
    assert not where.size, f"{len(where)} features out of tolerance, e.g. " + ", ".join(
        f"{names[tuple(i[-3:])]}: {used[tuple(i)]:.2f}x of it" for i in where[:5]
    )


def test_a_simulated_weld_takes_the_float32_path_within_tolerance():
    rec = simulate_weld(WeldCondition("new", "new", "clean", "Cu-Cu", 0.5), np.random.default_rng(3))
    fast, exact = extract_features(rec), extract_features(rec, precision="float64")
    # Not bit-identical: the float32 path ran (else the speed claim would be about nothing) ...
    assert not np.array_equal(fast, exact)
    # ... and stayed within the stated tolerance of float64 and of the independent reference.
    assert_within_tolerance(fast, exact, rec.n_samples, DEFAULT_SCHEMA)
    ref = extract_features_reference(rec.select(CH), DEFAULT_SCHEMA, sample_rate=FS)
    assert_within_tolerance(fast, ref, rec.n_samples, DEFAULT_SCHEMA)


@pytest.mark.parametrize("n", [28_672, 100_000])
def test_weld_like_signals_within_tolerance(n):
    x = signals(n, n)
    rec = WeldRecording(x, CH, FS, "p", datetime(2024, 1, 1, tzinfo=UTC))
    assert_within_tolerance(
        extract_features(rec), extract_features(rec, precision="float64"), n, DEFAULT_SCHEMA
    )


def test_degenerate_channels_take_the_float64_path_exactly():
    """Silent bands (zeros, a constant) are below float32's floor: those channels are redone in
    float64, so their silent/constant defaults hold exactly; a step stays within tolerance."""
    n = 30_000
    x = np.stack(
        [np.zeros(n), np.full(n, 3.5), np.r_[np.zeros(n // 2), np.ones(n - n // 2)], signals(n, 1)[3]]
    )
    rec = WeldRecording(x, CH, FS, "d", datetime(2024, 1, 1, tzinfo=UTC))
    fast, exact = extract_features(rec), extract_features(rec, precision="float64")
    nb = len(DEFAULT_SCHEMA.bands) * 12
    np.testing.assert_array_equal(fast[: 2 * nb], exact[: 2 * nb])
    assert_within_tolerance(fast, exact, n, DEFAULT_SCHEMA)


@pytest.mark.filterwarnings("error")
def test_signals_beyond_float32_range_take_the_float64_path():
    x = signals(30_000, 2) * 1e36  # finite in float64, overflows float32 (and its squares)
    rec = WeldRecording(x, CH, FS, "big", datetime(2024, 1, 1, tzinfo=UTC))
    fast = extract_features(rec)
    assert np.isfinite(fast).all()
    np.testing.assert_array_equal(fast, extract_features(rec, precision="float64"))


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match=r"precision must be one of \('auto', 'float64'\)"):
        extract_batch(np.zeros((1, 4, 30_000)), sample_rate=FS, precision="float16")


SMALL = FeatureSchema(level=6)


# The inputs of the existing property tests (test_dwt_features' lengths, dtypes, offsets and
# amplitudes; test_dwt_reference's levels, wavelets and weld-like signals), fast against float64.
@settings(max_examples=examples(30), deadline=None)
@given(
    n=st.integers(SMALL.min_samples, 6000),
    dtype=st.sampled_from([np.int16, np.int32, np.float32, np.float64]),
    offset=st.floats(-1e4, 1e4),
    amplitude=st.sampled_from([0.0, 1e-6, 1.0, 3e3]),
    seed=st.integers(0, 2**16),
)
def test_property_inputs_within_tolerance(n, dtype, offset, amplitude, seed):
    x = property_signals(n, dtype, offset, amplitude, seed)
    fast = extract_batch(x, SMALL, sample_rate=FS)
    assert np.isfinite(fast).all()
    assert_within_tolerance(fast, extract_batch(x, SMALL, sample_rate=FS, precision="float64"), n, SMALL)


@settings(max_examples=examples(20), deadline=None)
@given(
    n=st.integers(7 * 2**7, 9000),
    level=st.integers(3, 7),
    order=st.sampled_from([2, 4, 6]),
    dtype=st.sampled_from([np.float32, np.float64, np.int16]),
    seed=st.integers(0, 2**16),
)
def test_property_weld_like_inputs_within_tolerance(n, level, order, dtype, seed):
    schema = FeatureSchema(wavelet=f"db{order}", level=level)
    n = max(n, schema.min_samples)
    x = signals(n, seed)
    x = (x / np.abs(x).max(axis=1, keepdims=True) * 30_000 if dtype == np.int16 else x).astype(dtype)
    fast = extract_batch(x[None], schema, sample_rate=FS)
    assert_within_tolerance(
        fast, extract_batch(x[None], schema, sample_rate=FS, precision="float64"), n, schema
    )

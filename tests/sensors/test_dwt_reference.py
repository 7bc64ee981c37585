"""Parity: PyWavelets features against the plain-NumPy reference (own filters, own DWT, own statistics).

Parity is the float64 path's contract (``precision="float64"``); the default path may use
float32 within the tolerance that tests/sensors/test_dwt_precision.py pins.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest
import pywt
from hypothesis import given, settings
from hypothesis import strategies as st

from sensors.features import DEFAULT_SCHEMA, FeatureSchema, extract_batch, extract_features
from sensors.features.reference import (
    daubechies_lowpass,
    decomposition_filters,
    extract_features_reference,
    wavedec_reference,
)
from sensors.welding import WeldRecording
from tests.budget import examples

FS = 200_000.0
CH = ("power", "lvdt", "ae", "mic")


@pytest.mark.parametrize("order", range(1, 11))
def test_daubechies_filters_from_spectral_factorisation_match_pywavelets(order):
    w = pywt.Wavelet(f"db{order}")
    np.testing.assert_allclose(daubechies_lowpass(order), w.rec_lo, rtol=0, atol=1e-13)
    lo, hi = decomposition_filters(f"db{order}")
    np.testing.assert_allclose(lo, w.dec_lo, atol=1e-13)
    np.testing.assert_allclose(hi, w.dec_hi, atol=1e-13)


@pytest.mark.filterwarnings("ignore:Level value of 1 is too high")
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 13, 100, 1001, 28_672])
def test_wavedec_matches_pywavelets_symmetric_mode(n):
    x = np.random.default_rng(n).normal(size=(3, n))
    level = max(1, min(5, pywt.dwt_max_level(n, 8) or 1))
    ours = wavedec_reference(x, "db4", level)
    theirs = pywt.wavedec(x, "db4", mode="symmetric", level=level, axis=-1)
    assert [c.shape for c in ours] == [c.shape for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * np.abs(x).max())


def signals(n: int, seed: int) -> np.ndarray:
    """Weld-like channels with very different scales and offsets."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / FS
    return np.stack(
        [
            2500 * (1 - np.exp(-t / 0.01)) + 40 * rng.standard_normal(n),
            0.08 * (1 - np.exp(-t / 0.03)) + 5e-4 * rng.standard_normal(n),
            0.3 * np.sin(2 * np.pi * 20_030 * t) + 0.02 * rng.standard_cauchy(n).clip(-50, 50),
            0.6 * np.sin(2 * np.pi * 19_990 * t) * (1 + 0.3 * np.sin(2 * np.pi * 300 * t))
            + 0.05 * rng.standard_normal(n),
        ]
    )


def assert_parity(ours: np.ndarray, ref: np.ndarray, schema: FeatureSchema) -> None:
    # rtol 1e-9: float64 with different summation orders; atol for values that are ~0 by symmetry
    bad = ~np.isclose(ours, ref, rtol=1e-9, atol=1e-9)
    names = np.array(schema.feature_names())
    assert not bad.any(), (
        f"{bad.sum()} features differ, e.g. {list(zip(names[bad][:5], ours[bad][:5], ref[bad][:5], strict=True))}"
    )


@pytest.mark.parametrize("n", [28_672, 40_001, 100_000])
def test_default_features_match_the_numpy_reference(n):
    x = signals(n, n)
    rec = WeldRecording(x, CH, FS, "p", datetime(2024, 1, 1, tzinfo=UTC))
    assert_parity(
        extract_features(rec, precision="float64"),
        extract_features_reference(x, DEFAULT_SCHEMA, sample_rate=FS),
        DEFAULT_SCHEMA,
    )


def test_parity_on_degenerate_channels():
    n = 30_000
    x = np.stack(
        [np.zeros(n), np.full(n, 3.5), np.r_[np.zeros(n // 2), np.ones(n - n // 2)], signals(n, 1)[3]]
    )
    rec = WeldRecording(x, CH, FS, "d", datetime(2024, 1, 1, tzinfo=UTC))
    ours = extract_features(rec, precision="float64")
    assert np.isfinite(ours).all()
    assert_parity(ours, extract_features_reference(x, DEFAULT_SCHEMA, sample_rate=FS), DEFAULT_SCHEMA)


@settings(max_examples=examples(20), deadline=None)
@given(
    n=st.integers(7 * 2**7, 9000),
    level=st.integers(3, 7),
    order=st.sampled_from([2, 4, 6]),
    dtype=st.sampled_from([np.float32, np.float64, np.int16]),
    seed=st.integers(0, 2**16),
)
def test_parity_over_lengths_levels_wavelets_and_dtypes(n, level, order, dtype, seed):
    schema = FeatureSchema(wavelet=f"db{order}", level=level)
    if n < schema.min_samples:
        n = schema.min_samples
    x = signals(n, seed)
    x = (x / np.abs(x).max(axis=1, keepdims=True) * 30_000 if dtype == np.int16 else x).astype(dtype)
    ours = extract_batch(x[None], schema, sample_rate=FS, precision="float64")[0]
    assert_parity(ours, extract_features_reference(x, schema, sample_rate=FS), schema)


def test_reference_refuses_what_it_does_not_implement():
    with pytest.raises(NotImplementedError, match="only dbN"):
        wavedec_reference(np.zeros(100), "sym4", 2)
    with pytest.raises(NotImplementedError, match="only 'symmetric'"):
        wavedec_reference(np.zeros(100), "db4", 2, mode="periodization")

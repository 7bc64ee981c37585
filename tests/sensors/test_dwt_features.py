"""DWT features: the 624-vector, its schema and hash, batching, lengths, dtypes."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sensors.features import (
    DEFAULT_SCHEMA,
    SCHEMA_HASH_KEY,
    SCHEMA_JSON_KEY,
    STATS,
    FeatureInputError,
    FeatureSchema,
    SchemaMismatchError,
    check_model_metadata,
    check_schema,
    extract_batch,
    extract_features,
    extract_many,
    schema_hash,
    schema_metadata,
)
from sensors.welding import WeldRecording
from tests.budget import examples

CH = ("power", "lvdt", "ae", "mic")
FS = 200_000.0
#: The default schema's hash.  If this test fails the recipe changed: bump
#: FeatureSchema.version, retrain and re-export models, then update this value.
PINNED_HASH = "724b64af6bb9e25b51129e689e6fec9de2017ec5461ecea07b913e38f157f2f2"


def weld(n: int, seed: int = 0, channels=CH) -> WeldRecording:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / FS
    data = np.stack(
        [
            2000 * (1 - np.exp(-t / 0.02)) + 30 * rng.standard_normal(n),
            0.1 * (1 - np.exp(-t / 0.05)) + 1e-3 * rng.standard_normal(n),
            0.2 * np.sin(2 * np.pi * 20_000 * t) + 0.05 * rng.standard_normal(n),
            0.5 * np.sin(2 * np.pi * 20_000 * t + 1) + 0.1 * rng.standard_normal(n),
        ]
    )[: len(channels)]
    return WeldRecording(data, channels, FS, f"W{seed}", datetime(2024, 1, 1, tzinfo=UTC))


def test_default_vector_is_624_features_in_documented_layout():
    assert DEFAULT_SCHEMA.n_features == 624 == 4 * 13 * 12
    assert DEFAULT_SCHEMA.bands == ("A12", *(f"D{k}" for k in range(12, 0, -1)))
    names = DEFAULT_SCHEMA.feature_names()
    assert len(names) == len(set(names)) == 624
    assert names[0] == "power.A12.mean" and names[-1] == "mic.D1.time_centroid"
    assert names[(2 * 13 + 10) * 12 + STATS.index("kurtosis")] == "ae.D3.kurtosis"
    f = extract_features(weld(40_000))
    assert f.shape == (624,) and f.dtype == np.float64 and np.isfinite(f).all()
    assert DEFAULT_SCHEMA.band_edges_hz()["D3"] == (12_500.0, 25_000.0)  # where the 20 kHz carrier sits


def test_features_say_what_they_claim():
    f = dict(zip(DEFAULT_SCHEMA.feature_names(), extract_features(weld(60_000)), strict=True))
    # the 20 kHz carrier lives in D3 (12.5-25 kHz) for AE and mic: it holds most of their energy
    for ch in ("ae", "mic"):
        fracs = {b: f[f"{ch}.{b}.energy_frac"] for b in DEFAULT_SCHEMA.bands}
        assert max(fracs, key=fracs.get) == "D3" and fracs["D3"] > 0.5
    # the power ramp lives in the approximation band
    assert f["power.A12.energy_frac"] > 0.99 and f["power.A12.mean"] > 0
    fracs = [f[f"ae.{b}.energy_frac"] for b in DEFAULT_SCHEMA.bands]
    assert sum(fracs) == pytest.approx(1.0)
    for b in DEFAULT_SCHEMA.bands:
        assert 0 < f[f"mic.{b}.energy_spread"] <= 1 and 0 <= f[f"mic.{b}.time_centroid"] <= 1
        assert 0 <= f[f"mic.{b}.zero_cross_rate"] <= 1 and f[f"mic.{b}.crest"] >= 1


def test_impulsive_bursts_raise_kurtosis_and_crest():
    quiet, bursty = weld(50_000, seed=1), weld(50_000, seed=1)
    data = bursty.data.copy()
    for k in range(5):
        data[2, 5000 + 9000 * k : 5000 + 9000 * k + 60] += 3.0 * np.sin(np.arange(60) * 2.2)
    bursty = WeldRecording(data, CH, FS, "B", bursty.started_at)
    names = DEFAULT_SCHEMA.feature_names()
    a, b = extract_features(quiet), extract_features(bursty)
    i = names.index("ae.D1.kurtosis")
    assert b[i] > a[i] + 5 and b[names.index("ae.D1.crest")] > a[names.index("ae.D1.crest")]


def test_schema_hash_is_stable_and_pinned():
    assert schema_hash() == DEFAULT_SCHEMA.schema_hash() == FeatureSchema().schema_hash() == PINNED_HASH
    again = subprocess.run(
        [sys.executable, "-c", "from sensors.features import schema_hash; print(schema_hash())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert again == PINNED_HASH
    assert FeatureSchema.from_json(DEFAULT_SCHEMA.to_json()) == DEFAULT_SCHEMA
    canonical = json.loads(DEFAULT_SCHEMA.to_json())
    assert canonical["n_features"] == 624 and list(canonical) == sorted(canonical)


@pytest.mark.parametrize(
    "change",
    [
        {"version": 2},
        {"wavelet": "sym4"},
        {"level": 11},
        {"sample_rate": 250_000},
        {"channels": ("power", "lvdt", "mic", "ae")},
        {"mode": "periodization"},
        {"max_samples": 10**6},
    ],
)
def test_every_recipe_change_changes_the_hash(change):
    assert DEFAULT_SCHEMA.replace(**change).schema_hash() != PINNED_HASH


def test_mismatch_is_refused_with_a_clear_error():
    other = DEFAULT_SCHEMA.replace(level=10, sample_rate=250_000)
    check_schema(PINNED_HASH)
    check_schema(DEFAULT_SCHEMA.to_dict())
    with pytest.raises(
        SchemaMismatchError, match=r"model was built for feature schema sha256 [0-9a-f]{16}\.\.\., but"
    ):
        check_schema(other.schema_hash())
    with pytest.raises(
        SchemaMismatchError, match=r"level: model 10 vs device 12.*sample_rate: model 250000.0"
    ):
        check_schema(other.to_dict())
    meta = schema_metadata()
    check_model_metadata(meta)
    with pytest.raises(SchemaMismatchError, match=r"no 'ioft\.feature_schema\.sha256'"):
        check_model_metadata({})
    with pytest.raises(SchemaMismatchError, match="does not match its schema hash"):
        check_model_metadata({SCHEMA_HASH_KEY: other.schema_hash(), SCHEMA_JSON_KEY: meta[SCHEMA_JSON_KEY]})
    with pytest.raises(SchemaMismatchError, match="differing fields"):
        check_model_metadata(schema_metadata(other))
    tampered = {**DEFAULT_SCHEMA.to_dict(), "n_features": 500}
    with pytest.raises(SchemaMismatchError, match="inconsistent"):
        FeatureSchema.from_dict(tampered)


def test_invalid_schemas_list_their_problems():
    with pytest.raises(ValueError) as err:
        FeatureSchema(wavelet="db99x", level=0, stats=("mean", "median"), channels=())
    for text in ("wavelet", "level", "stats", "channels"):
        assert text in str(err.value)


def test_batch_matches_per_weld_and_variable_lengths_group():
    welds = [weld(30_000, 1), weld(45_000, 2), weld(30_000, 3), weld(52_000, 4)]
    rows = extract_many(welds)
    for rec, row in zip(welds, rows, strict=True):
        np.testing.assert_array_equal(row, extract_features(rec))
    stack = np.stack([welds[0].data, welds[2].data])
    np.testing.assert_array_equal(extract_batch(stack, sample_rate=FS), rows[[0, 2]])


def test_length_invariance_of_the_statistics():
    """A 0.5 s and a 0.9 s weld of the same stationary process give close feature values."""
    rng = np.random.default_rng(7)
    names = DEFAULT_SCHEMA.feature_names()
    short = extract_features(WeldRecording(rng.standard_normal((4, 100_000)), CH, FS, "s", datetime.now(UTC)))
    long = extract_features(WeldRecording(rng.standard_normal((4, 180_000)), CH, FS, "l", datetime.now(UTC)))
    for stat, atol in (
        ("std", 0.02),
        ("log_energy", 0.02),
        ("energy_frac", 0.02),
        ("energy_spread", 0.02),
        ("zero_cross_rate", 0.02),
        ("time_centroid", 0.02),
        ("kurtosis", 0.15),
    ):
        idx = [i for i, n in enumerate(names) if n.endswith(f".D2.{stat}")]
        np.testing.assert_allclose(short[idx], long[idx], rtol=0.05, atol=atol)


def test_inputs_that_do_not_fit_are_refused():
    with pytest.raises(FeatureInputError, match="28672"):
        extract_features(weld(20_000))
    slow = WeldRecording(np.zeros((4, 40_000)), CH, 192_000, "s", datetime.now(UTC), min_sample_rate=100)
    with pytest.raises(FeatureInputError) as err:
        extract_features(slow)
    assert all(noun in str(err.value) for noun in ("192000 Hz", "feature schema", "200000 Hz")), err.value
    with pytest.raises(ValueError, match=r"lacks channel\(s\) \['mic'\]"):
        extract_features(weld(40_000, channels=CH[:3]))
    with pytest.raises(FeatureInputError, match="shaped"):
        extract_batch(np.zeros((2, 3, 40_000)), sample_rate=FS)
    bad = np.zeros((1, 4, 40_000))
    bad[0, 1, 7] = np.inf
    with pytest.raises(FeatureInputError, match="NaN or inf"):
        extract_batch(bad, sample_rate=FS)


SMALL = FeatureSchema(level=6)  # min_samples 448: keeps the property tests fast


def property_signals(n: int, dtype, offset: float, amplitude: float, seed: int) -> np.ndarray:
    """Two 4-channel recordings of ``n`` samples: noise at ``offset`` and ``amplitude``, in ``dtype``
    (rounded and clipped to its range for integers); the property tests' inputs."""
    raw = offset + amplitude * np.random.default_rng(seed).standard_normal((2, 4, n))
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        raw = np.clip(np.round(raw), info.min, info.max)
    return raw.astype(dtype)


@settings(max_examples=examples(30), deadline=None)
@given(
    n=st.integers(SMALL.min_samples, 6000),
    dtype=st.sampled_from([np.int16, np.int32, np.float32, np.float64]),
    offset=st.floats(-1e4, 1e4),
    amplitude=st.sampled_from([0.0, 1e-6, 1.0, 3e3]),
    seed=st.integers(0, 2**16),
)
def test_any_length_and_dtype_gives_finite_consistent_features(n, dtype, offset, amplitude, seed):
    x = property_signals(n, dtype, offset, amplitude, seed)
    rows = extract_batch(x, SMALL, sample_rate=FS)
    assert rows.shape == (2, SMALL.n_features) and np.isfinite(rows).all()
    rec = WeldRecording(x[1], CH, FS, "h", datetime(2024, 1, 1, tzinfo=UTC))
    np.testing.assert_array_equal(rows[1], extract_features(rec, SMALL))
    fr = rows[:, [i for i, name in enumerate(SMALL.feature_names()) if name.endswith("energy_frac")]]
    sums = fr.reshape(2, 4, -1).sum(axis=-1)
    assert np.all((np.abs(sums - 1) < 1e-9) | (sums == 0))

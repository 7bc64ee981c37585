"""DWT band statistics of a weld: the 624-feature vector FTL-TP feeds its MLP.

FTL-TP (§3.2) says only "DWT, 624 features".  Our recipe (schema version 1):

    624 = 4 channels x 13 bands x 12 statistics

**Channels** (feature order): ``power``, ``lvdt``, ``ae``, ``mic``.

**Bands**: ``pywt.wavedec(x, "db4", mode="symmetric", level=12)``, giving
``A12, D12, D11, ..., D1``.  At 200 kHz the detail band ``Dk`` spans
``100 kHz / 2**k .. 100 kHz / 2**(k-1)``: D1 50-100 kHz (AE bursts, carrier
harmonics), D2 25-50 kHz (2nd harmonic), D3 12.5-25 kHz (the 20 kHz carrier), D4
6-12 kHz (subharmonics of a cracked or loose tool), D5-D9 0.2-6 kHz (stick-slip,
chatter), D10-D12 24-195 Hz and A12 0-24 Hz (power ramp, LVDT indentation profile).
Level 12 is the deepest that keeps every level free of pure boundary effects down to
``min_samples = 7 * 2**12 = 28,672`` samples (0.14 s), so every FTL-TP weld time
(0.5, 0.9, 1.0 s) fits; 13 octave bands span 24 Hz to 100 kHz.  db4 is short (8 taps,
good time resolution for bursts) yet smooth enough to separate octaves; symmetric
extension avoids the artificial step that periodic extension would add where a weld's
start and end differ (power ramps up, not down).

**Statistics** per band, with ``c`` the band's ``n`` coefficients, ``e = c**2``,
``E = sum(e)``, ``rms = sqrt(E / n)``.  All are normalised by ``n`` so that 0.5 s and
0.9 s welds give comparable values:

===================  ===============================================================
``mean``             ``mean(c)`` (level of slow channels in A12)
``std``              population standard deviation
``mean_abs``         ``mean(|c|)``
``max_abs``          ``max(|c|)``
``log_energy``       ``log10(max(E / n, floor))``: band power over a wide dynamic range;
                     ``floor = max((1e-10 * channel rms)**2, 1e-30)``
``energy_frac``      ``E / (sum of E over the channel's bands)``: spectral shape
``crest``            ``max_abs / rms``: impulsiveness (AE bursts)
``skewness``         ``m3 / std**3`` (central moments)
``kurtosis``         ``m4 / std**4 - 3`` (excess): bursts, cracks
``energy_spread``    ``E**2 / (n * sum(e**2))``: ``exp`` of the Rényi-2 entropy of the
                     energy over time, divided by ``n``; 1 = spread evenly, 1/n = one
                     coefficient, ~1/3 for Gaussian noise whatever the length
``zero_cross_rate``  fraction of adjacent pairs going from above ``+t`` to below
                     ``-t`` or back, ``t = 1e-6 * rms`` (dust near 0 ignored):
                     dominant frequency within the band
``time_centroid``    ``sum(k * e_k) / (E * (n - 1))``: when in the weld the band's energy
                     arrives (0 = start, 1 = end)
===================  ===============================================================

Degenerate bands get defined values instead of NaN: a band whose rms is at most
``1e-10`` of the channel's rms is *silent* (crest, skewness, kurtosis, energy spread,
zero-crossing rate 0; time centroid 0.5), and a band whose std is at most ``1e-9`` of
its rms (a constant) has skewness and kurtosis 0.

The layout is channel-major: ``index = (channel * 13 + band) * 12 + stat``;
:meth:`~sensors.features.schema.FeatureSchema.feature_names` spells it out.  Every vector
is returned in float64.  Batches of equal-length welds go through one
``wavedec(..., axis=-1)`` call, which matches a per-weld loop exactly.

**Precision.**  By default (``precision="auto"``) each channel is transformed in float32
after its mean is removed in float64, which makes the transform about twice as fast; a
channel whose estimated float32 error exceeds :data:`~sensors.features.precision.F32_TOLERANCE`
(silent or near-silent bands, a slow ramp's quiet octaves) is redone in float64.  The
features then stay within the contract of :mod:`sensors.features.precision` (``FEATURE_RTOL``
= 2e-3 of the float64 value plus its scale); ``precision="float64"`` matches the plain-NumPy
reference to rtol 1e-9.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import pywt

from sensors.features.precision import PRECISIONS, float32_ok
from sensors.features.schema import DEFAULT_SCHEMA, STATS, FeatureSchema
from sensors.features.stats import (  # the reference imports the thresholds from here
    CONSTANT_REL,
    LOG_FLOOR,
    SILENT_REL,
    ZERO_CROSS_REL,
    band_statistics,
    band_statistics_and_energy,
)
from sensors.welding.recording import WeldDataError, WeldRecording

log = logging.getLogger(__name__)

#: Samples (all channels) per wavedec call in batch mode: bounds the scratch memory.  A
#: batch is not reliably faster per weld than one weld at a time (benchmarks/dwt_features.py
#: measures both in the same run).
BATCH_SAMPLES = 1 << 20
__all__ = [
    "BATCH_SAMPLES",
    "CONSTANT_REL",
    "LOG_FLOOR",
    "PRECISIONS",
    "SILENT_REL",
    "ZERO_CROSS_REL",
    "FeatureInputError",
    "band_statistics",
    "check_input",
    "extract_batch",
    "extract_features",
    "extract_many",
]


class FeatureInputError(WeldDataError):
    """A signal does not fit the feature schema (rate, channels or length)."""


def check_input(n_samples: int, sample_rate: float, schema: FeatureSchema) -> None:
    """Raise :class:`FeatureInputError` unless a signal of this length and rate fits ``schema``."""
    if not math.isclose(float(sample_rate), schema.sample_rate, rel_tol=1e-9):
        raise FeatureInputError(
            f"signal sampled at {sample_rate:g} Hz but the feature schema expects {schema.sample_rate:g} Hz; "
            "record at the schema's rate or use a schema built for this rate"
        )
    if not schema.min_samples <= n_samples <= schema.max_samples:
        raise FeatureInputError(
            f"signal of {n_samples} samples ({n_samples / schema.sample_rate:.4g} s) is outside the schema's "
            f"{schema.min_samples}..{schema.max_samples} samples ({schema.wavelet} level {schema.level} needs "
            f">= {schema.min_samples}); shorter welds need a schema with a lower level"
        )


def _decompose(x: np.ndarray, schema: FeatureSchema) -> list[np.ndarray]:
    return pywt.wavedec(x, schema.wavelet, mode=schema.mode, level=schema.level, axis=-1)


def _features(x: np.ndarray, schema: FeatureSchema, precision: str) -> np.ndarray:
    """Band statistics ``(..., n_bands, 12)`` of signals ``(..., n_samples)`` of any real dtype."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    lead, n = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n)
    if precision == "float64":
        out = band_statistics(_decompose(np.asarray(rows, dtype=np.float64), schema))
        return out.reshape(*lead, *out.shape[-2:])
    # Remove each channel's mean in float64 first: float32 then only has to hold the variation,
    # and the approximation band gets the mean back exactly (the transform of a constant).
    mean = rows.mean(axis=-1, dtype=np.float64)
    y = np.empty(rows.shape, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        # a row beyond float32's range comes out non-finite and is redone in float64 below
        np.subtract(rows, mean[:, None], out=y, casting="same_kind")
        coeffs = _decompose(y, schema)
        out, energy = band_statistics_and_energy(coeffs, mean)
    counts = np.array([c.shape[-1] for c in coeffs], dtype=np.float64)
    redo = ~(float32_ok(energy, counts) & np.isfinite(out).all(axis=(-2, -1)))
    if redo.any():
        out[redo] = band_statistics(_decompose(np.asarray(rows[redo], dtype=np.float64), schema))
    return out.reshape(*lead, *out.shape[-2:])


def extract_batch(
    signals: np.ndarray,
    schema: FeatureSchema = DEFAULT_SCHEMA,
    *,
    sample_rate: float,
    precision: str = "auto",
) -> np.ndarray:
    """Features of equal-length welds, one ``wavedec(axis=-1)`` per chunk.

    Parameters
    ----------
    signals
        Shape ``(n_welds, n_channels, n_samples)`` with channels in schema order.
    schema
        The recipe.
    sample_rate
        Rate of ``signals``; must equal the schema's.
    precision
        One of :data:`PRECISIONS`.

    Returns
    -------
    numpy.ndarray
        Shape ``(n_welds, schema.n_features)``.
    """
    x = np.asarray(signals)
    if x.ndim != 3 or x.shape[1] != len(schema.channels):
        raise FeatureInputError(
            f"signals must be shaped (n_welds, {len(schema.channels)} channels {schema.channels}, n_samples); "
            f"got {x.shape}"
        )
    check_input(x.shape[-1], sample_rate, schema)
    out = np.empty((x.shape[0], schema.n_features), dtype=np.float64)
    step = max(1, BATCH_SAMPLES // (x.shape[1] * x.shape[2]))
    for start in range(0, x.shape[0], step):
        chunk = x[start : start + step]
        # A sum is NaN/inf if any element is (no temporary mask); confirm elementwise only then.
        if not np.isfinite(chunk.sum(dtype=np.float64)) and not np.isfinite(chunk).all():
            raise FeatureInputError(
                f"signals contain NaN or inf (in welds {start}..{start + len(chunk) - 1})"
            )
        stats = _features(chunk, schema, precision)
        out[start : start + chunk.shape[0]] = _select(stats, schema).reshape(chunk.shape[0], -1)
    return out


def _select(stats: np.ndarray, schema: FeatureSchema) -> np.ndarray:
    """Keep the schema's statistics (all 12 unless a custom schema picks fewer)."""
    if schema.stats == STATS:
        return stats
    return stats[..., [STATS.index(s) for s in schema.stats]]


def extract_features(
    recording: WeldRecording, schema: FeatureSchema = DEFAULT_SCHEMA, *, precision: str = "auto"
) -> np.ndarray:
    """The feature vector of one weld.

    Parameters
    ----------
    recording
        Must have every schema channel (extra channels are ignored), the schema's
        sample rate and a length in ``schema.min_samples .. schema.max_samples``.
    precision
        One of :data:`PRECISIONS`.

    Returns
    -------
    numpy.ndarray
        Shape ``(schema.n_features,)``, float64.
    """
    check_input(recording.n_samples, recording.sample_rate, schema)
    x = recording.select(schema.channels)
    return _select(_features(x, schema, precision), schema).reshape(-1)


def extract_many(
    recordings: Sequence[WeldRecording], schema: FeatureSchema = DEFAULT_SCHEMA, *, precision: str = "auto"
) -> np.ndarray:
    """Feature rows for welds of any lengths, batching those of equal length.

    Returns
    -------
    numpy.ndarray
        Shape ``(len(recordings), schema.n_features)`` in input order.
    """
    out = np.empty((len(recordings), schema.n_features), dtype=np.float64)
    groups: dict[int, list[int]] = {}
    for i, rec in enumerate(recordings):
        check_input(rec.n_samples, rec.sample_rate, schema)
        groups.setdefault(rec.n_samples, []).append(i)
    for idx in groups.values():
        stack = np.stack([recordings[i].select(schema.channels) for i in idx])
        out[idx] = extract_batch(stack, schema, sample_rate=schema.sample_rate, precision=precision)
    return out

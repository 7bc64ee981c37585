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
:meth:`~sensors.features.schema.FeatureSchema.feature_names` spells it out.  All work
is in float64.  Batches of equal-length welds go through one ``wavedec(..., axis=-1)``
call, which matches a per-weld loop exactly.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence

import numpy as np
import pywt

from sensors.features.schema import DEFAULT_SCHEMA, STATS, FeatureSchema
from sensors.welding.recording import WeldDataError, WeldRecording

log = logging.getLogger(__name__)

LOG_FLOOR = 1e-30
SILENT_REL = 1e-10
CONSTANT_REL = 1e-9
ZERO_CROSS_REL = 1e-6
#: Samples (all channels) per wavedec call in batch mode.  Batching saves Python
#: overhead on short welds; past ~1 M samples the arrays fall out of cache and a
#: bigger batch is slower per weld (measured in benchmarks/dwt_features.py).
BATCH_SAMPLES = 1 << 20
_DOT = "ri,ri->r"
#: float32 dot products are summed in blocks this long, the blocks' sums in float64.
_BLOCK = 4096
#: Power sums give the central moments to ~1e-14 while mean**2 <= 0.01 var; rows past it
#: are recomputed about their mean (the approximation band, offsets, constants).
_RAW_MOMENTS_MAX = 1e-2


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


class _Workspace:
    """Scratch buffers reused across bands (and across calls, when small).

    Fresh multi-megabyte temporaries cost a page fault per 4 KiB on first touch, which
    measured as most of the statistics' time here; reusing two float buffers and three
    boolean masks keeps the work to a few passes over memory already mapped.
    """

    CACHE_BYTES = 32 << 20

    def __init__(self, rows: int, n_max: int, dtype: np.dtype) -> None:
        self.key = (rows, n_max, dtype)
        self.f1 = np.empty((rows, n_max), dtype=dtype)
        self.f2 = np.empty((rows, n_max), dtype=dtype)
        self.b1 = np.empty((rows, n_max), dtype=bool)
        self.b2 = np.empty((rows, n_max), dtype=bool)
        self.b3 = np.empty((rows, n_max - 1), dtype=bool)
        self.ramp = np.arange(n_max, dtype=dtype)

    @classmethod
    def get(cls, rows: int, n_max: int, dtype: np.dtype) -> _Workspace:
        """A workspace for ``rows`` rows of up to ``n_max`` values; the most recent few are kept."""
        cache: dict[tuple[int, int, np.dtype], _Workspace] = getattr(_LOCAL, "ws", None) or {}
        key = (rows, n_max, np.dtype(dtype))
        ws = cache.pop(key, None) or cls(rows, n_max, np.dtype(dtype))
        if ws.nbytes > cls.CACHE_BYTES:  # a huge weld: not worth holding on to
            return ws
        cache[key] = ws  # most recent last
        while len(cache) > 1 and sum(w.nbytes for w in cache.values()) > cls.CACHE_BYTES:
            del cache[next(iter(cache))]
        _LOCAL.ws = cache
        return ws

    @property
    def nbytes(self) -> int:
        return self.f1.nbytes + self.f2.nbytes + self.b1.nbytes + self.b2.nbytes + self.b3.nbytes


_LOCAL = threading.local()


def _dot_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``sum(a * b, axis=-1)`` per row (``b`` may be one row for all), accumulated in float64.

    float32 accumulation over 10^5 terms loses ~1e-5; float32 rows are summed in blocks of
    :data:`_BLOCK` (einsum's own float32 loop) whose partial sums are added in float64.
    """
    rows, n = a.shape
    if a.dtype == np.float64 or n < 2 * _BLOCK:
        spec = _DOT if b.ndim == 2 else "ri,i->r"
        return np.einsum(spec, a, b, dtype=np.float64) if a.dtype != np.float64 else np.einsum(spec, a, b)
    main = n - n % _BLOCK
    head_a = a[:, :main].reshape(rows, -1, _BLOCK)
    if b.ndim == 2:
        part = np.einsum("rki,rki->rk", head_a, b[:, :main].reshape(rows, -1, _BLOCK))
        tail = np.einsum(_DOT, a[:, main:], b[:, main:], dtype=np.float64)
    else:
        part = np.einsum("rki,ki->rk", head_a, b[:main].reshape(-1, _BLOCK))
        tail = np.einsum("ri,i->r", a[:, main:], b[main:], dtype=np.float64)
    return part.sum(axis=-1, dtype=np.float64) + tail


def _band_sums(c: np.ndarray, ws: _Workspace) -> list[np.ndarray]:
    """One band's sums ``[S1, S2, S3, S4, sum k*c_k^2, sum |c|, max |c|, crossings]`` per row.

    Every statistic comes from these: the moments from power sums about zero (detail bands
    have a mean far below their spread, so no cancellation; :func:`_central_moments` redoes
    the rows where that fails), the rest from one pass each over ``c**2`` and ``|c|``.
    """
    n = c.shape[-1]
    e = np.multiply(c, c, out=ws.f1[:, :n])
    s1 = c.sum(axis=-1, dtype=np.float64) if n < 2 * _BLOCK else c.sum(axis=-1).astype(np.float64)
    s2 = e.sum(axis=-1).astype(np.float64)
    s3 = _dot_rows(e, c)
    s4 = _dot_rows(e, e)
    cen = _dot_rows(e, ws.ramp[:n])
    a = np.abs(c, out=ws.f2[:, :n])
    sa = a.sum(axis=-1).astype(np.float64)
    mx = a.max(axis=-1).astype(np.float64)
    # Zero crossings: |c| > t on both sides and a sign change, t = 1e-6 rms (dust near 0 ignored);
    # the same pairs as "above +t then below -t or back".
    t = (ZERO_CROSS_REL * np.sqrt(s2 / n)).astype(c.dtype)[:, None]
    big = np.greater(a, t, out=ws.b1[:, :n])
    neg = np.signbit(c, out=ws.b2[:, :n])
    flip = np.not_equal(neg[:, 1:], neg[:, :-1], out=ws.b3[:, : n - 1])
    flip &= big[:, 1:]
    flip &= big[:, :-1]
    # count_nonzero per row: ~10x faster than count_nonzero(axis=-1) on a 2-D mask
    zc = np.array([np.count_nonzero(row) for row in flip], dtype=np.float64)
    return [s1, s2, s3, s4, cen, sa, mx, zc]


def _central_moments(c: np.ndarray, s1, s2, s3, s4) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = c.shape[-1]
    mean = s1 / n
    ms = s2 / n
    var = ms - mean * mean
    m3 = s3 / n - mean * (3.0 * ms - 2.0 * mean * mean)
    m4 = s4 / n - mean * (4.0 * s3 / n - mean * (6.0 * ms - 3.0 * mean * mean))
    redo = np.flatnonzero(~(mean * mean <= _RAW_MOMENTS_MAX * var))
    if redo.size:
        d = c[redo].astype(np.float64)
        mean[redo] = d.mean(axis=-1)
        d -= mean[redo, None]
        d2 = d * d
        var[redo] = d2.sum(axis=-1) / n
        m3[redo] = np.einsum(_DOT, d2, d) / n
        m4[redo] = np.einsum(_DOT, d2, d2) / n
    return mean, np.maximum(var, 0.0), m3, m4


def band_statistics(coeffs: Sequence[np.ndarray], *, shift: np.ndarray | None = None) -> np.ndarray:
    """The 12 statistics of every band, vectorised over leading axes.

    Parameters
    ----------
    coeffs
        ``wavedec`` output: float arrays (float32 or float64) shaped ``(..., n_b)``, all
        with the same leading shape.
    shift
        Shape ``(...)``: the channel means removed before the transform; the approximation
        band gets ``shift * sqrt(2)**level`` back (the transform of a constant), in float64.

    Returns
    -------
    numpy.ndarray
        Shape ``(..., n_bands, 12)`` in :data:`~sensors.features.schema.STATS` order, float64.
    """
    out, _ = _band_statistics(coeffs, shift)
    return out


def _band_statistics(coeffs: Sequence[np.ndarray], shift: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`band_statistics` and each band's energy ``(..., n_bands)`` before ``shift``."""
    lead = coeffs[0].shape[:-1]
    rows = math.prod(lead)
    nb = len(coeffs)
    counts = np.array([c.shape[-1] for c in coeffs], dtype=np.float64)
    sums = np.empty((8, rows, nb))
    moments = np.empty((4, rows, nb))
    raw_energy = np.empty((rows, nb))
    for b, band in enumerate(coeffs):
        c = band.reshape(rows, -1) if band.ndim != 2 else band
        if b == 0 and shift is not None:
            raw_energy[:, 0] = np.einsum(_DOT, c, c, dtype=np.float64)
            c = c.astype(np.float64) + (shift.reshape(rows) * math.sqrt(2.0) ** (len(coeffs) - 1))[:, None]
        shifted = b == 0 and shift is not None  # its own small float64 workspace
        ws = _Workspace.get(rows, c.shape[-1] if shifted else int(counts.max()), c.dtype)
        s = _band_sums(c, ws)
        sums[:, :, b] = s
        moments[:, :, b] = _central_moments(c, *s[:4])
        if b or shift is None:
            raw_energy[:, b] = s[1]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # float32 rows that overflow come out non-finite and are redone in float64 by the caller
        out = _combine(sums, moments, counts)
    return out.reshape(*lead, nb, 12), raw_energy.reshape(*lead, nb)


def _combine(sums: np.ndarray, moments: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The statistics ``(rows, n_bands, 12)`` from the per-band sums and central moments."""
    _, E, _, _, cen, sa, mx, zc = sums
    mean, var, m3, m4 = moments
    ms = E / counts
    rms = np.sqrt(ms)
    std = np.sqrt(var)
    safe_rms = np.where(rms > 0, rms, 1.0)
    safe_std = np.where(std > 0, std, 1.0)
    safe_E = np.where(E > 0, E, 1.0)
    varying = std > CONSTANT_REL * rms
    out = np.empty((*E.shape, 12))
    out[..., 0] = mean
    out[..., 1] = std
    out[..., 2] = sa / counts
    out[..., 3] = mx
    total = E.sum(axis=-1, keepdims=True)
    out[..., 5] = E / np.where(total > 0, total, 1.0)
    out[..., 6] = mx / safe_rms
    out[..., 7] = np.where(varying, m3 / safe_std**3, 0.0)
    out[..., 8] = np.where(varying, m4 / safe_std**4 - 3.0, 0.0)
    out[..., 9] = safe_E * (safe_E / (counts * np.where(sums[3] > 0, sums[3], 1.0)))
    out[..., 10] = zc / (counts - 1)
    out[..., 11] = cen / (safe_E * (counts - 1))
    # Silent bands (numerical dust of an empty channel): their power reads as the silence
    # floor and their shape statistics are meaningless, so both get fixed values.
    channel_rms = np.sqrt(total / counts.sum())
    floor = np.maximum((SILENT_REL * channel_rms) ** 2, LOG_FLOOR)
    out[..., 4] = np.log10(np.maximum(ms, floor))
    silent = rms <= SILENT_REL * channel_rms
    for k, default in ((6, 0.0), (7, 0.0), (8, 0.0), (9, 0.0), (10, 0.0), (11, 0.5)):
        out[..., k] = np.where(silent, default, out[..., k])
    return out


def _decompose(x: np.ndarray, schema: FeatureSchema) -> list[np.ndarray]:
    return pywt.wavedec(x, schema.wavelet, mode=schema.mode, level=schema.level, axis=-1)


#: ``precision`` values: ``"auto"`` transforms in float32 each channel whose estimated
#: float32 error stays within :data:`F32_TOLERANCE` (the rest in float64); ``"float64"``
#: does all in float64, matching the NumPy reference to rtol 1e-9.
PRECISIONS = ("auto", "float64")
#: Largest estimated relative rms error the float32 transform may leave on any band's
#: coefficients of a channel; past it the channel is redone in float64.  The features then
#: stay within :data:`FEATURE_RTOL` of the float64 ones (tests/sensors/test_dwt_precision.py).
F32_TOLERANCE = 1e-3
#: What float32 may change in a feature: ``|auto - float64| <= FEATURE_RTOL * (|float64| + scale)``
#: with scale 1 for the scale-free statistics and the band's rms for mean, std, mean_abs, max_abs;
#: ``zero_cross_rate`` by at most :data:`ZERO_CROSS_SLACK` crossings.
FEATURE_RTOL = 2e-3
ZERO_CROSS_SLACK = 4
# Rounding in the float32 filter bank is ~eps32 of the approximation each band is split from;
# the measured error stayed below 11x that estimate on weld-like signals: 16x is the bound used.
_F32_EPS = float(np.finfo(np.float32).eps) / 2
_F32_BOUND = 16.0


def _float32_ok(energy: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Rows whose float32 coefficients are within :data:`F32_TOLERANCE` (a-posteriori estimate).

    ``energy`` is ``(rows, n_bands)`` of the mean-removed transform in ``wavedec`` order; the
    approximation a detail band is split from holds the energy of that band and all before it.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        parent_rms = np.sqrt(np.cumsum(energy, axis=-1) / (2.0 * counts))
        band_rms = np.sqrt(energy / counts)
        est = _F32_BOUND * _F32_EPS * parent_rms / band_rms
        return np.all(est <= F32_TOLERANCE, axis=-1)


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
    np.subtract(rows, mean[:, None], out=y, casting="same_kind")
    coeffs = _decompose(y, schema)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        # a float32 row that overflows comes out non-finite and is redone in float64 below
        out, energy = _band_statistics(coeffs, mean)
    counts = np.array([c.shape[-1] for c in coeffs], dtype=np.float64)
    redo = ~(_float32_ok(energy, counts) & np.isfinite(out).all(axis=(-2, -1)))
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

"""A plain-NumPy reference of the DWT features, independent of PyWavelets.

Two uses: the parity test (PyWavelets' features must match these to tight tolerance,
which checks both our use of ``wavedec`` and the vectorised statistics in
:mod:`sensors.features.dwt`) and the benchmark (what PyWavelets buys us).  Written
for clarity, not speed:

* the Daubechies filters are built from scratch by spectral factorisation of the
  Daubechies polynomial (no table of coefficients, no PyWavelets);
* one DWT level is a convolution of the half-sample symmetric extension
  (PyWavelets' ``"symmetric"`` mode) with the decomposition filter, keeping every
  second output starting at index 1, which gives ``floor((n + F - 1) / 2)``
  coefficients as PyWavelets does;
* the statistics are computed one band and one channel at a time with the textbook
  formulas of the :mod:`sensors.features.dwt` docstring.

Only ``dbN`` wavelets and ``symmetric`` mode are implemented.
"""

from __future__ import annotations

import math
import re
from math import comb

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from sensors.features.dwt import CONSTANT_REL, LOG_FLOOR, SILENT_REL, ZERO_CROSS_REL, check_input
from sensors.features.schema import STATS, FeatureSchema


def daubechies_lowpass(order: int) -> np.ndarray:
    """The dbN scaling (reconstruction low-pass) filter of length ``2 * order``.

    Spectral factorisation: ``|H(w)|**2 = cos(w/2)**(2N) * P(sin(w/2)**2)`` with
    ``P(y) = sum_k C(N-1+k, k) y**k``; each root ``y`` of ``P`` gives a pair ``z, 1/z``
    through ``y = (2 - z - 1/z) / 4`` and the minimum-phase filter keeps the root
    inside the unit circle.  Normalised to ``sum(h) = sqrt(2)``.
    """
    if not 1 <= order <= 20:
        raise ValueError(f"Daubechies order must be in 1..20 (numerically stable range); got {order}")
    coeffs = [comb(order - 1 + k, k) for k in range(order)]
    poly = np.array([1.0 + 0j])
    for _ in range(order):
        poly = np.convolve(poly, [1.0, 1.0])
    if order > 1:
        for y in np.roots(coeffs[::-1]):
            pair = np.roots([1.0, 4.0 * y - 2.0, 1.0])
            poly = np.convolve(poly, [1.0, -pair[np.argmin(np.abs(pair))]])
    h = np.real(poly)
    return h * math.sqrt(2.0) / h.sum()


def decomposition_filters(wavelet: str) -> tuple[np.ndarray, np.ndarray]:
    """``(dec_lo, dec_hi)`` for ``"dbN"``: time-reversed scaling filter and its QMF."""
    match = re.fullmatch(r"db(\d+)", wavelet)
    if not match:
        raise NotImplementedError(f"the NumPy reference implements only dbN wavelets, not {wavelet!r}")
    rec_lo = daubechies_lowpass(int(match.group(1)))
    dec_lo = rec_lo[::-1].copy()
    k = np.arange(len(rec_lo))
    dec_hi = ((-1.0) ** (k + 1)) * rec_lo  # dec_hi[k] = (-1)**(k+1) * dec_lo[F-1-k]
    return dec_lo, dec_hi


def dwt_level(x: np.ndarray, dec_lo: np.ndarray, dec_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One symmetric-mode DWT level along the last axis: ``(approximation, detail)``."""
    F = len(dec_lo)
    pad = [(0, 0)] * (x.ndim - 1) + [(F - 1, F - 1)]
    ext = np.pad(x, pad, mode="symmetric")
    windows = sliding_window_view(ext, F, axis=-1)[..., 1::2, :]
    return windows @ dec_lo[::-1], windows @ dec_hi[::-1]


def wavedec_reference(x: np.ndarray, wavelet: str, level: int, mode: str = "symmetric") -> list[np.ndarray]:
    """Multilevel DWT in ``pywt.wavedec`` order: ``[cA_level, cD_level, ..., cD_1]``."""
    if mode != "symmetric":
        raise NotImplementedError(f"the NumPy reference implements only 'symmetric' mode, not {mode!r}")
    dec_lo, dec_hi = decomposition_filters(wavelet)
    details = []
    approx = np.asarray(x, dtype=np.float64)
    for _ in range(level):
        approx, detail = dwt_level(approx, dec_lo, dec_hi)
        details.append(detail)
    return [approx, *details[::-1]]


def _band_stats(c: np.ndarray, channel_rms: float, band_total: float) -> list[float]:
    n = len(c)
    E = float(np.sum(c**2))
    rms = math.sqrt(E / n)
    mean = float(np.mean(c))
    std = float(np.std(c))
    max_abs = float(np.max(np.abs(c)))
    floor = max((SILENT_REL * channel_rms) ** 2, LOG_FLOOR)
    values = {
        "mean": mean,
        "std": std,
        "mean_abs": float(np.mean(np.abs(c))),
        "max_abs": max_abs,
        "log_energy": math.log10(max(E / n, floor)),
        "energy_frac": E / band_total if band_total > 0 else 0.0,
    }
    if rms <= SILENT_REL * channel_rms:
        values.update(
            crest=0.0, skewness=0.0, kurtosis=0.0, energy_spread=0.0, zero_cross_rate=0.0, time_centroid=0.5
        )
        return [values[s] for s in STATS]
    centred = c - mean
    constant = std <= CONSTANT_REL * rms
    p = c**2 / E
    t = ZERO_CROSS_REL * rms
    above, below = c > t, c < -t
    signs_flip = (above[1:] & below[:-1]) | (below[1:] & above[:-1])
    values.update(
        crest=max_abs / rms,
        skewness=0.0 if constant else float(np.mean(centred**3)) / std**3,
        kurtosis=0.0 if constant else float(np.mean(centred**4)) / std**4 - 3.0,
        energy_spread=1.0 / (n * float(np.sum(p**2))),
        zero_cross_rate=float(np.sum(signs_flip)) / (n - 1),
        time_centroid=float(np.sum(np.arange(n) * p)) / (n - 1),
    )
    return [values[s] for s in STATS]


def statistics_reference(coeffs: list[np.ndarray], schema: FeatureSchema) -> np.ndarray:
    """Feature vector from ``wavedec``-ordered coefficients shaped ``(n_channels, n_b)``."""
    keep = [STATS.index(s) for s in schema.stats]
    rows = []
    for c in range(coeffs[0].shape[0]):
        bands = [b[c] for b in coeffs]
        energies = [float(np.sum(b**2)) for b in bands]
        total = sum(energies)
        channel_rms = math.sqrt(total / sum(len(b) for b in bands))
        for band in bands:
            stats = _band_stats(band, channel_rms, total)
            rows.extend(stats[k] for k in keep)
    return np.asarray(rows, dtype=np.float64)


def extract_features_reference(
    signals: np.ndarray, schema: FeatureSchema, *, sample_rate: float
) -> np.ndarray:
    """Features of one weld ``(n_channels, n_samples)`` (channels in schema order).

    Returns
    -------
    numpy.ndarray
        Shape ``(schema.n_features,)``, the same layout as
        :func:`sensors.features.dwt.extract_features`.
    """
    x = np.asarray(signals, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != len(schema.channels):
        raise ValueError(f"signals must be shaped ({len(schema.channels)}, n_samples); got {x.shape}")
    check_input(x.shape[1], sample_rate, schema)
    return statistics_reference(wavedec_reference(x, schema.wavelet, schema.level, schema.mode), schema)

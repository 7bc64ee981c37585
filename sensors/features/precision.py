"""What the default feature path may change, and when it falls back to float64.

``precision="auto"`` (the default of :func:`~sensors.features.extract_features` and friends)
transforms each channel in float32 after removing its mean in float64, then estimates the
float32 rounding on every band from the result itself: the filter bank rounds at ~eps32 of
the approximation a band is split from, so a band far quieter than its parent (a silent
band, dust, a slow ramp's high octaves) gets a large estimate and its channel is redone in
float64.  Measured on weld-like signals the actual error stayed below 11x the estimate;
:data:`F32_TOLERANCE` applies to 16x it.

The contract (pinned by ``tests/sensors/test_dwt_precision.py`` against float64, on the
property-test inputs too): ``|auto - float64| <= FEATURE_RTOL * (|float64| + scale)`` per
feature, with ``scale`` the band's rms for ``mean``, ``std``, ``mean_abs``, ``max_abs`` and 1
for the scale-free statistics; ``zero_cross_rate`` may also differ by
:data:`ZERO_CROSS_SLACK` crossings (a coefficient within rounding of the dust threshold).
``precision="float64"`` matches the plain-NumPy reference to rtol 1e-9.
"""

from __future__ import annotations

import numpy as np

from sensors.features.schema import STATS

PRECISIONS = ("auto", "float64")
#: Largest estimated relative rms error float32 may leave on any band of a channel.
F32_TOLERANCE = 1e-3
FEATURE_RTOL = 2e-3
ZERO_CROSS_SLACK = 4
_F32_EPS = float(np.finfo(np.float32).eps) / 2
_F32_BOUND = 16.0
_SCALED = [STATS.index(s) for s in ("mean", "std", "mean_abs", "max_abs")]
_ZC = STATS.index("zero_cross_rate")
_LOG_ENERGY = STATS.index("log_energy")


def float32_ok(energy: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Rows whose float32 transform is within :data:`F32_TOLERANCE` (a-posteriori estimate).

    Parameters
    ----------
    energy
        ``(rows, n_bands)``: each band's energy of the mean-removed transform, ``wavedec``
        order (the approximation a detail band is split from holds the energy of that band
        and of all before it).
    counts
        Coefficients per band.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        parent_rms = np.sqrt(np.cumsum(energy, axis=-1) / (2.0 * counts))
        band_rms = np.sqrt(energy / counts)
        est = _F32_BOUND * _F32_EPS * parent_rms / band_rms
        return np.all(est <= F32_TOLERANCE, axis=-1)


def tolerance_used(fast: np.ndarray, exact: np.ndarray, band_lengths: np.ndarray) -> np.ndarray:
    """How much of the contract each feature uses: ``> 1`` is out of tolerance.

    Parameters
    ----------
    fast, exact
        Statistics shaped ``(..., n_bands, 12)`` (all of :data:`STATS`, in order).
    band_lengths
        Coefficients per band, ``(n_bands,)``.
    """
    scale = np.ones_like(exact)
    scale[..., _SCALED] = np.sqrt(10.0 ** exact[..., _LOG_ENERGY])[..., None]
    diff = np.abs(fast - exact)
    used = diff / (FEATURE_RTOL * (np.abs(exact) + scale))
    crossings = diff[..., _ZC] * (np.asarray(band_lengths, dtype=np.float64) - 1)
    used[..., _ZC] = np.minimum(used[..., _ZC], crossings / ZERO_CROSS_SLACK)
    return used

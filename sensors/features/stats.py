"""The 12 statistics of every DWT band (definitions in :mod:`sensors.features.dwt`).

Each band is read a few times, not once per statistic: the moments come from power sums
(``sum c``, ``sum c**2``, ``sum c**3``, ``sum c**4``) in the same passes that give the energy,
energy spread and time centroid; ``|c|`` is formed once for the mean, the maximum and the
zero crossings.  The short bands go through together (one ``reduceat`` per sum).  Bands may
be float32 (the default path of :mod:`sensors.features.dwt`): their dot products are summed
in float64 over blocks, everything after the sums is float64.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence

import numpy as np

LOG_FLOOR = 1e-30
SILENT_REL = 1e-10
CONSTANT_REL = 1e-9
ZERO_CROSS_REL = 1e-6
_DOT = "ri,ri->r"
#: float32 dot products are summed in blocks this long, the blocks' sums in float64.
_BLOCK = 4096
#: Power sums give the central moments to ~1e-14 while mean**2 <= 0.01 var; rows past it
#: are recomputed about their mean (the approximation band, offsets, constants).
_RAW_MOMENTS_MAX = 1e-2


class _Workspace:
    """Scratch buffers reused across bands (and across calls, when small).

    Fresh multi-megabyte temporaries cost a page fault per 4 KiB on first touch, which
    measured as most of the statistics' time here; reusing two float buffers and three
    boolean masks keeps the work to a few passes over memory already mapped.
    """

    CACHE_BYTES = 32 << 20

    def __init__(self, rows: int, n_max: int, dtype: np.dtype) -> None:
        self.f1 = np.empty((rows, n_max), dtype=dtype)
        self.f2 = np.empty((rows, n_max), dtype=dtype)
        self.b1 = np.empty((rows, n_max), dtype=bool)
        self.b2 = np.empty((rows, n_max), dtype=bool)
        self.b3 = np.empty((rows, n_max - 1), dtype=bool)
        self.ramp = np.arange(n_max, dtype=dtype)  # exact in float32 up to 2**24 coefficients

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
    spec = _DOT if b.ndim == 2 else "ri,i->r"
    if a.dtype == np.float64:
        return np.einsum(spec, a, b)
    if n < 2 * _BLOCK:
        return np.einsum(spec, a, b, dtype=np.float64)
    main = n - n % _BLOCK
    head_a = a[:, :main].reshape(rows, -1, _BLOCK)
    if b.ndim == 2:
        part = np.einsum("rki,rki->rk", head_a, b[:, :main].reshape(rows, -1, _BLOCK))
        tail = np.einsum(spec, a[:, main:], b[:, main:], dtype=np.float64)
    else:
        part = np.einsum("rki,ki->rk", head_a, b[:main].reshape(-1, _BLOCK))
        tail = np.einsum(spec, a[:, main:], b[main:], dtype=np.float64)
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


def _central_moments(
    c: np.ndarray, s1: np.ndarray, s2: np.ndarray, s3: np.ndarray, s4: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, variance and third and fourth central moments per row from the power sums of ``c``."""
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

    Examples
    --------
    One channel, two bands: a steady oscillation, and a burst late in the weld.

    >>> import numpy as np
    >>> from sensors.features.schema import STATS
    >>> tone = np.array([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0]])
    >>> burst = np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0, 0.0]])
    >>> stats = band_statistics([tone, burst])
    >>> stats.shape
    (1, 2, 12)
    >>> for band in stats[0]:
    ...     row = dict(zip(STATS, band.round(3).tolist()))
    ...     print(row["crest"], row["energy_frac"], row["zero_cross_rate"], row["time_centroid"])
    1.0 0.333 1.0 0.5
    2.828 0.667 0.0 0.857
    """
    out, _ = band_statistics_and_energy(coeffs, shift)
    return out


def band_statistics_and_energy(
    coeffs: Sequence[np.ndarray], shift: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`band_statistics` and each band's energy ``(..., n_bands)`` before ``shift``."""
    lead = coeffs[0].shape[:-1]
    rows = math.prod(lead)
    nb = len(coeffs)
    counts = np.array([c.shape[-1] for c in coeffs], dtype=np.float64)
    sums = np.empty((8, rows, nb))
    moments = np.empty((4, rows, nb))
    raw_energy = np.empty((rows, nb))
    flat = [band.reshape(rows, -1) for band in coeffs]
    gain = math.sqrt(2.0) ** (nb - 1)  # the approximation band of a constant 1
    # The short bands (wavedec order runs from shortest to longest) go through together: per
    # band the fixed cost of ~20 NumPy calls would exceed their arithmetic.
    k = next((b for b, c in enumerate(flat) if c.shape[-1] > SMALL_BAND), nb)
    if k:
        _small_bands(flat[:k], shift, gain, sums[:, :, :k], moments[:, :, :k], raw_energy[:, :k])
    for b in range(k, nb):
        c = flat[b]
        if b == 0 and shift is not None:
            raw_energy[:, 0] = np.einsum(_DOT, c, c, dtype=np.float64)
            c = c.astype(np.float64) + (shift.reshape(rows) * gain)[:, None]
        s = _band_sums(c, _Workspace.get(rows, int(counts.max()), c.dtype))
        sums[:, :, b] = s
        moments[:, :, b] = _central_moments(c, *s[:4])
        if b or shift is None:
            raw_energy[:, b] = s[1]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # float32 rows that overflow come out non-finite and are redone in float64 by the caller
        out = _combine(sums, moments, counts)
    return out.reshape(*lead, nb, 12), raw_energy.reshape(*lead, nb)


#: Bands up to this long are handled together by :func:`_small_bands`.
SMALL_BAND = 4096


def _small_bands(
    bands: Sequence[np.ndarray],
    shift: np.ndarray | None,
    gain: float,
    sums: np.ndarray,
    moments: np.ndarray,
    raw_energy: np.ndarray,
) -> None:
    """:func:`_band_sums` and :func:`_central_moments` of several short bands in one go.

    The bands ``(rows, n_b)`` are laid end to end in float64 and every sum is a
    ``reduceat`` over their offsets; the moments are taken about each band's mean (two
    passes, exact whatever the offset).  Results are written into the ``(..., len(bands))``
    arrays given.
    """
    lengths = [c.shape[-1] for c in bands]
    idx = np.cumsum([0, *lengths[:-1]])
    n = np.array(lengths, dtype=np.float64)
    g = np.concatenate(bands, axis=-1, dtype=np.float64)
    if shift is not None:
        raw_energy[:, 0] = np.einsum(_DOT, g[:, : lengths[0]], g[:, : lengths[0]])
        g[:, : lengths[0]] += (shift.reshape(-1) * gain)[:, None]
    s1 = np.add.reduceat(g, idx, axis=-1)
    mean = s1 / n
    d = g - np.repeat(mean, lengths, axis=-1)
    d2 = d * d
    moments[0] = mean
    moments[1] = np.add.reduceat(d2, idx, axis=-1) / n
    moments[2] = np.add.reduceat(d2 * d, idx, axis=-1) / n
    moments[3] = np.add.reduceat(np.multiply(d2, d2, out=d), idx, axis=-1) / n
    e = np.multiply(g, g, out=d2)
    s2 = np.add.reduceat(e, idx, axis=-1)
    if shift is None:
        raw_energy[:, 0] = s2[:, 0]
    raw_energy[:, 1:] = s2[:, 1:]
    sums[0], sums[1] = s1, s2
    sums[3] = np.add.reduceat(e * e, idx, axis=-1)
    sums[4] = np.add.reduceat(e * _ramps(tuple(lengths)), idx, axis=-1)
    neg = np.signbit(g)
    a = np.abs(g, out=g)
    sums[5] = np.add.reduceat(a, idx, axis=-1)
    sums[6] = np.maximum.reduceat(a, idx, axis=-1)
    # Zero crossings as in _band_sums; the pair that straddles two bands is not counted.
    big = a > np.repeat(ZERO_CROSS_REL * np.sqrt(s2 / n), lengths, axis=-1)
    flip = np.not_equal(neg[:, 1:], neg[:, :-1])
    flip &= big[:, 1:]
    flip &= big[:, :-1]
    flip[:, idx[1:] - 1] = False
    sums[7] = np.add.reduceat(flip, idx, axis=-1, dtype=np.int64)
    sums[2] = np.nan  # S3 is not needed: the moments above are already central


@functools.lru_cache(maxsize=16)
def _ramps(lengths: tuple[int, ...]) -> np.ndarray:
    """``0, 1, ..., n_b - 1`` for each band, end to end."""
    return np.concatenate([np.arange(n, dtype=np.float64) for n in lengths])


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

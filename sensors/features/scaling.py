"""Per-feature standardisation of feature rows (z-scores), fitted on rows the caller owns.

The 624 DWT features span about ten decades: per-feature standard deviations from
~1e-8 (silent bands) to ~100 (energies, crest factors), and a raw weld row has
‖x‖² of the order of 1e5.  An MLP with Kaiming-normal weights expects inputs of unit
scale, and any penalty on a layer's activations (FTL-TP's and FedL2R's L2R term)
weighs against the classification loss in proportion to the input scale, so rows are
standardised before training:

    z = (x − mean) / std      (std ≤ ``min_std`` → 1: a constant feature stays centred)

:meth:`Standardizer.fit` fits on one array (a device's own training rows: local,
nothing leaves the device).  Statistics over several devices need only each
device's ``n``, ``Σx`` and ``Σx²`` (:func:`feature_sums`, one message per device);
:meth:`Standardizer.from_sums` combines them and :func:`pool_feature_sums` does so only over
enough devices, robustly (a task's ``scaling = "fleet"``: the aggregator and the studies call
it; one device's lie moves the result a bounded amount).  All are deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

#: A feature whose standard deviation is at most this is treated as constant (scale 1).
MIN_STD = 1e-12


def feature_sums(x: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """``(n, Σx, Σx²)`` over the rows of ``x`` (float64): what a device shares for global statistics."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"feature_sums needs a non-empty 2-D array of rows, got shape {x.shape}")
    return len(x), x.sum(axis=0), np.square(x).sum(axis=0)


@dataclass(frozen=True)
class Standardizer:
    """Per-feature ``mean`` and ``std`` (constant features: 1); :meth:`transform` applies them."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray, *, min_std: float = MIN_STD) -> Standardizer:
        """Mean and population standard deviation of each column of ``x`` (two-pass, float64)."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or len(x) == 0:
            raise ValueError(f"Standardizer.fit needs a non-empty 2-D array of rows, got shape {x.shape}")
        std = x.std(axis=0)
        return cls(x.mean(axis=0), np.where(std > min_std, std, 1.0))

    @classmethod
    def from_sums(
        cls, sums: Iterable[tuple[int, np.ndarray, np.ndarray]], *, min_std: float = MIN_STD
    ) -> Standardizer:
        """Pooled statistics from several devices' :func:`feature_sums` (no rows needed)."""
        parts = list(sums)
        if not parts:
            raise ValueError("Standardizer.from_sums needs at least one device's (n, Σx, Σx²)")
        n = sum(p[0] for p in parts)
        mean = sum(p[1] for p in parts) / n
        var = np.maximum(sum(p[2] for p in parts) / n - np.square(mean), 0.0)
        std = np.sqrt(var)
        return cls(mean, np.where(std > min_std, std, 1.0))

    def transform(self, x: np.ndarray, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """``(x − mean) / std`` as ``dtype``; raises if the width differs from the fitted one."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != len(self.mean):
            raise ValueError(f"expected rows of {len(self.mean)} features, got shape {x.shape}")
        return ((x - self.mean) / self.std).astype(dtype)


#: The most training rows one device's statistics may count (as many as an upload's ``n_samples``
#: may claim by default: ``cloud_aggregator``'s ``AdmissionPolicy.max_samples``).
MAX_STATS_ROWS = 1_000_000
#: How far the pool lets one device stray from the median device, per feature: its row count
#: counts at most ``CLIP_RATIO ×`` the median device's, its deviation lies within a factor
#: ``CLIP_RATIO`` of the median device's, and its mean within ``CLIP_RATIO × √(s² + d²)`` of the
#: median device's mean (``s`` the median device's deviation, ``d`` the devices' means' spread,
#: 1.4826 × their median absolute deviation).
CLIP_RATIO = 3.0


def sums_refusal(
    n: int, total: np.ndarray, sumsq: np.ndarray, *, width: int | None = None, max_rows: int = MAX_STATS_ROWS
) -> str | None:
    """Why one device's ``(n, Σx, Σx²)`` cannot be pooled (one line), or ``None``.

    Refused: another width than the task's model takes, more than ``max_rows`` rows, sums that
    overflow float64 (a mean or a variance that is not finite), and a variance below zero beyond
    rounding (``Σx² < (Σx)²/n``: no rows give that).
    """
    if width is not None and len(total) != width:
        return f"{len(total)} features per row; the task's model takes {width}"
    if len(total) != len(sumsq):
        return f"{len(total)} sums but {len(sumsq)} sums of squares"
    if not 1 <= n <= max_rows:
        return f"n = {n} rows; a device's statistics count 1 to {max_rows} rows"
    with np.errstate(over="ignore", invalid="ignore"):
        mean = np.asarray(total, dtype=np.float64) / n
        second = np.asarray(sumsq, dtype=np.float64) / n
        var = second - np.square(mean)
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(second)) and np.all(np.isfinite(var))):
        return "the sums overflow float64 (a mean or variance is not finite)"
    # Σx²/n − mean² of a constant feature rounds to a few ulps below zero; more is no data.
    if np.any(var < -1e-9 * second):
        return "Σx² < (Σx)²/n for some feature: a negative variance that no rows give"
    return None


def _moments(n: int, total: np.ndarray, sumsq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = total / n
    return mean, np.sqrt(np.maximum(sumsq / n - np.square(mean), 0.0))


def pool_feature_sums(
    sums: Mapping[str, tuple[int, np.ndarray, np.ndarray]], min_devices: int, *, ratio: float = CLIP_RATIO
) -> Standardizer:
    """The fleet's transform from ``device -> (n, Σx, Σx²)``, pooled in sorted device order.

    Robust to a minority of liars: per feature, each device's row count, mean and deviation
    are clipped toward the median device's (:data:`CLIP_RATIO`) before pooling, so one device
    moves the pooled mean by at most a few of the fleet's deviations and scales its deviation
    by a bounded factor, whatever it sends.  A device inside every bound is pooled from its own
    sums, bit for bit: an honest, homogeneous fleet gets exactly the statistics of all its rows.

    Raises ``ValueError`` for fewer than ``min_devices`` devices (pooled statistics of one
    device are its own; of two, each device can subtract its sums and hold the other's), for
    devices whose widths differ, or for sums :func:`sums_refusal` refuses.
    """
    if len(sums) < min_devices:
        raise ValueError(
            f"fleet scaling pools at least {min_devices} devices' statistics; have {len(sums)} "
            f"({', '.join(sorted(sums)) or 'none'})"
        )
    widths = {d: len(s[1]) for d, s in sums.items()}
    if len(set(widths.values())) > 1:
        raise ValueError(f"devices sent statistics of different widths: {dict(sorted(widths.items()))}")
    devices = sorted(sums)  # fixed order: the same bits everywhere
    for d in devices:
        why = sums_refusal(*sums[d], max_rows=np.iinfo(np.int64).max)
        if why is not None:
            raise ValueError(f"statistics of {d}: {why}")
    moments = [_moments(*sums[d]) for d in devices]
    means = np.array([m for m, _ in moments])
    med_mean = np.median(means, axis=0)
    med_std = np.median([s for _, s in moments], axis=0)
    # Devices of one fleet differ in more than noise (a material, a machine): the mean's reach is
    # the median device's deviation and the spread of the devices' means (1.4826 MAD: a deviation).
    reach = ratio * np.hypot(med_std, 1.4826 * np.median(np.abs(means - med_mean), axis=0))
    most_rows = int(ratio * float(np.median([sums[d][0] for d in devices])))
    parts = []
    for d, (mean, std) in zip(devices, moments, strict=True):
        n = min(sums[d][0], max(most_rows, 1))
        m = np.clip(mean, med_mean - reach, med_mean + reach)
        s = np.clip(std, med_std / ratio, med_std * ratio)
        if n == sums[d][0] and np.array_equal(m, mean) and np.array_equal(s, std):
            parts.append(sums[d])
        else:  # the clipped device stands for n rows of mean m and deviation s
            parts.append((n, n * m, n * (np.square(s) + np.square(m))))
    return Standardizer.from_sums(parts)


def standardize_locally(train_x: np.ndarray, test_x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both splits standardised with ``train_x``'s statistics (a task's ``scaling = "local"``).

    The device's own training rows fit the scaling, so nothing leaves the device; the same
    call serves the in-process simulator.  An empty training split is returned unchanged.
    """
    if len(train_x) == 0:
        return train_x, test_x
    scaler = Standardizer.fit(train_x)
    dtype = np.result_type(train_x.dtype, np.float32)
    return scaler.transform(train_x, dtype), scaler.transform(test_x, dtype)

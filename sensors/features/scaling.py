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
enough devices (a task's ``scaling = "fleet"``: the aggregator and the studies call it).  All
are deterministic.
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


def pool_feature_sums(
    sums: Mapping[str, tuple[int, np.ndarray, np.ndarray]], min_devices: int
) -> Standardizer:
    """The fleet's transform from ``device -> (n, Σx, Σx²)``, pooled in sorted device order.

    Raises ``ValueError`` for fewer than ``min_devices`` devices (pooled statistics of one
    device are its own; of two, each device can subtract its sums and hold the other's) or for
    devices whose widths differ.
    """
    if len(sums) < min_devices:
        raise ValueError(
            f"fleet scaling pools at least {min_devices} devices' statistics; have {len(sums)} "
            f"({', '.join(sorted(sums)) or 'none'})"
        )
    widths = {d: len(s[1]) for d, s in sums.items()}
    if len(set(widths.values())) > 1:
        raise ValueError(f"devices sent statistics of different widths: {dict(sorted(widths.items()))}")
    return Standardizer.from_sums(sums[d] for d in sorted(sums))  # fixed order: the same bits everywhere


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

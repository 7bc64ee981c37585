"""Local datasets and seeded minibatching."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Dataset:
    """Inputs ``x`` of shape ``(n, d)`` and targets ``y`` of shape ``(n, k)`` (or class ids ``(n,)``).

    ``domain`` optionally labels each sample's domain (FedDAR, FTL-TP).
    """

    x: np.ndarray
    y: np.ndarray
    domain: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.x.ndim != 2:
            raise ValueError(f"x must be 2-D (n, d), got shape {self.x.shape}")
        if len(self.y) != len(self.x):
            raise ValueError(f"x has {len(self.x)} rows but y has {len(self.y)}")
        if self.domain is not None and len(self.domain) != len(self.x):
            raise ValueError(f"x has {len(self.x)} rows but domain has {len(self.domain)}")
        if not (np.isfinite(self.x).all() and np.isfinite(self.y).all()):
            raise ValueError("dataset holds NaN or Inf")

    def __len__(self) -> int:
        return len(self.x)

    def take(self, idx: np.ndarray) -> Dataset:
        """The rows ``idx`` (copies), without re-checking values this dataset already passed."""
        dom = None if self.domain is None else self.domain[idx]
        return Dataset._trusted(self.x[idx], self.y[idx], dom)

    @classmethod
    def _trusted(cls, x: np.ndarray, y: np.ndarray, domain: np.ndarray | None) -> Dataset:
        # Minibatches are rows of a validated dataset: skipping the finiteness scan
        # keeps it off the per-step hot path.
        out = object.__new__(cls)
        object.__setattr__(out, "x", x)
        object.__setattr__(out, "y", y)
        object.__setattr__(out, "domain", domain)
        return out


def minibatches(
    data: Dataset, batch_size: int | None, rng: np.random.Generator, *, shuffle: bool = True
) -> Iterator[Dataset]:
    """One epoch of minibatches; ``batch_size=None`` yields the full batch."""
    n = len(data)
    if batch_size is None or batch_size >= n:
        yield data
        return
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = rng.permutation(n) if shuffle else np.arange(n)
    for start in range(0, n, batch_size):
        yield data.take(order[start : start + batch_size])


#: The share of a device's rows held out, newest first, to judge its models (at least 1 of >= 2 rows).
HOLDOUT_FRACTION = 0.2


#: The held-out rows also calibrate the serving model's conformal interval, which needs 9 of them
#: at 90 % coverage: a dataset of 40 or more rows holds out at least this many (a quarter of a
#: smaller one), so a printer after one print run answers with a bounded interval at once.
MIN_HOLDOUT = 10


def holdout_size(n: int, fraction: float = HOLDOUT_FRACTION) -> int:
    """How many of ``n`` time-ordered rows are held out: ``ceil(fraction·n)``, at least 1 when
    ``n >= 2`` and at least ``min(MIN_HOLDOUT, n // 4)``."""
    if n < 2 or fraction <= 0:
        return 0
    return min(n - 1, max(1, int(np.ceil(fraction * n)), min(MIN_HOLDOUT, n // 4)))


def newest_split(data: Dataset, fraction: float = HOLDOUT_FRACTION) -> tuple[Dataset, Dataset]:
    """``(older rows, newest rows)`` of a dataset stored oldest first (a time-ordered holdout).

    The newest rows judge models fitted on the older ones: a random split would let a model that
    drifted with the machine look as good as one that kept up.
    """
    h = holdout_size(len(data), fraction)
    n = len(data)
    return data.take(np.arange(n - h)), data.take(np.arange(n - h, n))

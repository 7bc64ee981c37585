"""Each sample's domain: the labels checked, and the per-domain counts a client uploads.

Shared by the algorithms that treat domains apart (:mod:`~trainer_lite.algorithms.feddar`,
:mod:`~trainer_lite.algorithms.feddar_linear`, :mod:`~trainer_lite.algorithms.separate`).
"""

from __future__ import annotations

import numpy as np

from trainer_lite.data import Dataset

#: The upload's name for ``L_{i,m}``, the client's samples per domain.
COUNTS = "domain_counts"


def domain_ids(data: Dataset, n_domains: int) -> np.ndarray:
    """The dataset's domain labels as integers in ``[0, n_domains)``; raises ``ValueError`` otherwise."""
    if data.domain is None:
        raise ValueError(
            "this algorithm needs each sample's domain: build the Dataset with domain=<int array (n,)>"
        )
    dom = np.asarray(data.domain)
    if dom.ndim != 1 or (dom.size and not np.array_equal(dom, np.round(dom))):
        raise ValueError(f"domain labels must be a 1-D array of integers, got {dom.dtype}{list(dom.shape)}")
    dom = dom.astype(np.intp)
    if dom.size and (dom.min() < 0 or dom.max() >= n_domains):
        raise ValueError(
            f"domain labels must lie in [0, {n_domains}) (n_domains={n_domains}), "
            f"got min {dom.min()}, max {dom.max()}"
        )
    return dom


def domain_counts(dom: np.ndarray, n_domains: int) -> np.ndarray:
    """``L_{i,m}``: samples per domain."""
    return np.bincount(dom, minlength=n_domains)

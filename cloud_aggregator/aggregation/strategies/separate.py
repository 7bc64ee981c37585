"""Separate FedAvg per domain, server side: each domain's copy averaged by that domain's sample counts.

``domain_m ← Σ_i L_{i,m} θ_{i,m} / Σ_i L_{i,m}``; a domain no participant holds
keeps its previous copy.  :func:`per_domain_mean` is also FedDAR-WA's head
aggregation; both take the configured reducer (``server.reducer``, as FedAvg's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cloud_aggregator.aggregation.reducers import Reducer, ReducerChoice, get_reducer
from cloud_aggregator.aggregation.strategies.base import Strategy, TensorSpec, register_strategy
from cloud_aggregator.aggregation.update import Update
from trainer_lite.algorithms.feddar import COUNTS
from trainer_lite.algorithms.separate import domain_key
from trainer_lite.params import Params


def upload_counts(updates: Sequence[Update], n_domains: int) -> np.ndarray:
    """The ``(n_updates, M)`` matrix of ``L_{i,m}``; raises ``ValueError`` naming a bad upload.

    Counts must be non-negative integers that add up to the upload's ``n_samples``.
    """
    rows = []
    for u in updates:
        c = np.asarray(u.params[COUNTS], dtype=np.float64)
        if c.shape != (n_domains,):
            raise ValueError(f"{u.device}: {COUNTS!r} has shape {c.shape}, expected ({n_domains},)")
        if (c < 0).any() or not np.array_equal(c, np.round(c)) or int(c.sum()) != u.n_samples:
            raise ValueError(
                f"{u.device}: {COUNTS!r} must be non-negative integers summing to n_samples="
                f"{u.n_samples}, got {c.tolist()}"
            )
        rows.append(c)
    return np.stack(rows)


def per_domain_mean(
    global_params: Mapping[str, np.ndarray],
    updates: Sequence[Update],
    counts: np.ndarray,
    keys: Callable[[int], list[str]],
    reduce: Reducer | None = None,
) -> Params:
    """Each domain's parameters ``keys(m)`` averaged over ``updates`` with weights ``counts[:, m]``.

    A domain whose counts are all zero keeps ``global_params``' values.  ``reduce``
    (default: the weighted mean) combines; uploads of weight 0 take no part in any reducer.
    """
    reduce = reduce or get_reducer("mean")
    out: Params = {}
    for m in range(counts.shape[1]):
        names = keys(m)
        if counts[:, m].sum() <= 0:
            out.update({n: np.array(global_params[n], copy=True) for n in names})
            continue
        out.update(
            reduce(
                global_params,
                [
                    ({n: u.params[n] for n in names}, float(c))
                    for u, c in zip(updates, counts[:, m], strict=True)
                ],
            )
        )
    return out


@dataclass(frozen=True)
class SeparateServerConfig(ReducerChoice):
    """Only the reducer: each copy is weighted by its domain's sample counts."""


@register_strategy
class SeparateFedAvg(Strategy):
    name = "separate_fedavg"
    config_cls = SeparateServerConfig

    def expected(self, global_params: Params, phase: str) -> dict[str, TensorSpec]:
        out = super().expected(global_params, phase)
        out[COUNTS] = TensorSpec((self.client.n_domains,), self.spec.dtype)
        return out

    def aggregate(
        self, global_params: Params, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        counts = upload_counts(updates, self.client.n_domains)
        names = self.client.model_names()
        return per_domain_mean(
            global_params,
            updates,
            counts,
            lambda m: [domain_key(m, n) for n in names],
            self.config.make_reducer(),
        )

"""Personalized PCA, server side: average the uploaded global components, then retract.

The talk's step 3 ("Server averages received U_(i),τ+1's, then retracts it to the
feasible set"): ``U_{τ+1} = GR_{U_τ}((1/N) Σ_i U_(i),τ+1)`` with the polar
retraction, i.e. the polar factor of the mean (:func:`trainer_lite.algorithms.perpca.polar`).
The mean of points on the Stiefel manifold is not on it; the polar factor is the
nearest orthonormal matrix with the same column space.

The mean's weights come from :mod:`cloud_aggregator.aggregation.weighting` (``"uniform"``,
the paper's 1/N, by default); only the names in the global dict travel (``U``).
The mean itself is the same ``reducer`` choice as FedAvg's
(:class:`cloud_aggregator.aggregation.reducers.ReducerChoice`): ``"mean"`` by default, or a robust
rule (``"clip"``, ``"median"``, ``"trimmed_mean"``, ``"krum"``), e.g.
``server = {reducer = "median"}``; the polar retraction then applies to its result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cloud_aggregator.aggregation.reducers import ReducerChoice
from cloud_aggregator.aggregation.strategies.base import Strategy, register_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.aggregation.weighting import get_weighting
from trainer_lite.algorithms.perpca import polar
from trainer_lite.params import Params


@dataclass(frozen=True)
class PerPCAServerConfig(ReducerChoice):
    """``weighting`` (and its ``weighting_args``) and ``reducer`` (and ``reducer_args``) of the
    mean before the retraction."""

    weighting: str = "uniform"
    weighting_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        get_weighting(self.weighting, self.weighting_args)


@register_strategy
class PerPCAStrategy(Strategy):
    name = "perpca"
    config_cls = PerPCAServerConfig

    def __init__(self, spec, client=None) -> None:
        super().__init__(spec, client)
        self.weigh = get_weighting(self.config.weighting, self.config.weighting_args)
        self.reduce = self.config.make_reducer()

    def aggregate(
        self, global_params: Params, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        weights = self.weigh(updates, round_)
        mean = self.reduce(global_params, [(u.params, w) for u, w in zip(updates, weights, strict=True)])
        dtype = np.asarray(global_params["U"]).dtype
        return {"U": polar(np.asarray(mean["U"], dtype=np.float64)).astype(dtype)}

    def state(self) -> dict[str, Any]:
        return self.weigh.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.weigh.load_state(state)

"""A zero-compute algorithm for measuring what a round costs in transport alone.

The model is one shared vector of ``size`` values (model ``"vector"``); a client adds a small scalar
(its own per device and round) and uploads it.  Nothing local, nothing to learn: a round's wall time is then the
system's overhead (announce, deliver, persist, upload, validate, aggregate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult, register_client
from trainer_lite.data import Dataset
from trainer_lite.params import Params


@dataclass(frozen=True)
class EchoConfig:
    step: float = 1e-3
    loss: str = "mse"


@register_client
class EchoClient(ClientAlgorithm):
    """Uploads the downlinked vector plus a step in ``[step, 2·step)``, distinct per device and round."""

    name = "echo"
    server = "fedavg"
    config_cls = EchoConfig

    def shared_names(self) -> list[str]:
        return ["v.value"]

    def init_local(self, rng: np.random.Generator) -> Params:
        return {}

    def personal_params(self, shared: Params, local: Params) -> Params:
        return dict(shared)

    def update(
        self,
        shared: Params,
        local: Params,
        data: Dataset,
        *,
        rng: np.random.Generator,
        round_: int,
        phase: str,
    ) -> tuple[ClientResult, Params]:
        # A step of its own size per device and round (from the round's seeded rng): identical
        # uploads from two devices would be refused as replays, as real updates never are.
        step = self.config.step * (1.0 + rng.random())
        out = {"v.value": shared["v.value"] + np.asarray(step, dtype=shared["v.value"].dtype)}
        return ClientResult(out, len(data), {}), {}

    def evaluate(self, shared: Params, local: Params, data: Dataset) -> dict[str, float]:
        return {}

"""FedPer (Arivazhagan et al. 2019): a shared body and a personal head.

A device trains body and head together on its data, uploads the body and keeps
the head.  Which blocks are personal is ``personal_blocks`` (block names of the
model, e.g. ``["decoder"]``); by default the model's last block with parameters.
The same machinery with the partition flipped is LG-FedAvg
(:mod:`trainer_lite.algorithms.lgfedavg`).

Cold start (a device that joins a trained fleet): the personal blocks are fitted to
the device's first rows with the downlinked shared blocks frozen
(:func:`~trainer_lite.algorithms.cold_start.fit_personal`; the grid search of
:func:`~trainer_lite.algorithms.cold_start.fit_affine_encoder` first when the
personal part is a one-feature affine encoder).  No personal block ever leaves a
device, so there is no global copy of it to start from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult, TrainConfig, register_client
from trainer_lite.algorithms.cold_start import affine_block, fit_affine_encoder, fit_personal
from trainer_lite.data import Dataset
from trainer_lite.params import Params, copy_params


@dataclass(frozen=True)
class PartialSharingConfig(TrainConfig):
    """``personal_blocks``: the model blocks that stay on the device (``None``: the default split)."""

    personal_blocks: tuple[str, ...] | None = None


class PartialSharingClient(ClientAlgorithm):
    """Train every parameter locally; upload only the shared blocks, keep the rest."""

    config_cls = PartialSharingConfig

    def default_personal_blocks(self) -> list[str]:
        """FedPer: the last block with parameters (the head)."""
        return [self._param_blocks()[-1]]

    def _param_blocks(self) -> list[str]:
        blocks = [name for name, layer in self.model.layers if layer.param_names()]
        if len(blocks) < 2:
            raise ValueError(
                f"{self.name} splits the model into shared and personal blocks, but it has only "
                f"{blocks} with parameters; use a model with at least two blocks"
            )
        return blocks

    def personal_names(self) -> list[str]:
        blocks = self.config.personal_blocks
        blocks = self.default_personal_blocks() if blocks is None else list(blocks)
        names = sorted(n for b in blocks for n in self.model.names(b))
        if not names or len(names) == len(self.model.param_names()):
            raise ValueError(f"personal blocks {blocks} must leave some parameters shared and keep some")
        return names

    def shared_names(self) -> list[str]:
        personal = set(self.personal_names())
        return sorted(n for n in self.model.param_names() if n not in personal)

    def init_local(self, rng: np.random.Generator) -> Params:
        full = self.model.init(rng)
        return {n: full[n] for n in self.personal_names()}

    def cold_start(
        self, shared: Params, local: Params, data: Dataset, *, rng: np.random.Generator, phase: str
    ) -> Params:
        """The personal blocks fitted through the frozen shared ones (module docstring)."""
        params = self.personal_params(shared, local)
        names = self.personal_names()
        blocks = sorted({n.split(".")[0] for n in names})
        if len(blocks) == 1 and affine_block(self, blocks[0]):
            params = fit_affine_encoder(self, params, blocks[0], data, rng)
        else:
            params = fit_personal(self, params, names, data, rng)
        return {n: params[n] for n in names}

    def personal_params(self, shared: Params, local: Params) -> Params:
        return {**{n: shared[n] for n in self.shared_names()}, **{n: local[n] for n in self.personal_names()}}

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
        params = copy_params(self.personal_params(shared, local))
        train_loss = self.local_steps(params, data, rng, round_=round_)
        uploaded = {n: params[n] for n in self.shared_names()}
        kept = {n: params[n] for n in self.personal_names()}
        return ClientResult(uploaded, len(data), {"train_loss": train_loss}), kept


@register_client
class FedPerClient(PartialSharingClient):
    """FedPer: shared body, personal head (by default the last block with parameters)."""

    name = "fedper"
    server = "fedavg"

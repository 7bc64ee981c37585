"""A device's serving side inside a study: ``edge-trainer``'s own :class:`edge.serving.server.Server`,
offered each simulated round's models as the daemon offers them (:meth:`edge.daemon.Daemon._offer`).

The studies (``field_accuracy``, ``newcomer --protocol lopo``) ask what a machine *serves*.  Its
answer is the device's whole admission: the candidates, their judge and its record
(:mod:`edge.serving.candidates`) and the gate that may keep an older model
(:mod:`edge.serving.gate`: the margin, the stale rule).  Running that code here, not a copy of its
rule, keeps the studies' served figures those of a device; and the candidates a study scores beside
the served model are the ones the device judged (:class:`Served`), not the study's rebuilds of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from edge.config import DeviceConfig
from edge.config_serve import ServeConfig
from edge.serving.candidates import Choice
from edge.serving.model import ServingModel
from edge.serving.server import Server
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.data import Dataset
from trainer_lite.params import Params


class Served(NamedTuple):
    """After one offered round: the model that serves (``kept``: an earlier round's, which the gate
    kept) and the round's judgement, its candidates included (``None`` where it judged none)."""

    model: ServingModel
    kept: bool
    choice: Choice | None


class ServedDevice:
    """One device's serving of one task, its state (the alone copies, the judging record, the
    serving model) under ``state_dir``; ``serve``: ``[serve]`` settings (the defaults otherwise)."""

    def __init__(self, device: str, task: str, state_dir: Path, **serve: Any) -> None:
        # hold_out_always: it judges without a recorder's feed, as make demo's printers do
        config = DeviceConfig(
            device=device, state_dir=str(state_dir), serve=ServeConfig(hold_out_always=True, **serve)
        )
        self.task = task
        self.server = Server(config, Path(state_dir), lambda _topic, _payload: None)

    @property
    def holdout(self):
        """``rows -> (the rows a round trains on, the newest ones that judge)``: the device's split."""
        return self.server.holdout

    def offer(
        self,
        algo: ClientAlgorithm,
        shared: Params,
        local: Params,
        train: Dataset,
        test: Dataset,
        round_: int,
        meta: dict[str, Any] | None = None,
    ) -> Served | None:
        """The round's models offered (``shared``: the downlink the round trained from, ``local``: the
        device's parts after it; ``train``: every training row as stored, the newest included); what
        serves after it (``None``: nothing yet) and the round's judgement."""
        self.server.choices.pop(self.task, None)
        rows = (train, test, None)
        self.server.offer(self.task, algo, shared, local, rows, (train, test, meta or {}), round_)
        model = self.server.models.get(self.task)
        if model is None:
            return None
        return Served(model, model.round < round_, self.server.choices.get(self.task))

    @property
    def refused(self) -> str | None:
        """The gate's last refusal (``None`` after an install)."""
        return self.server.gate.get(self.task)

"""The server half of an algorithm: how the cloud combines what devices uploaded.

A strategy is transport-free.  The round loop (``cloud_aggregator.rounds.engine``) owns
announce → collect → validate → aggregate → record; a strategy only says how
to start, what it expects, and how to combine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from cloud_aggregator.aggregation.reducers import ReducerChoice
from cloud_aggregator.aggregation.strategies.privacy import PrivateMean, dp_refusal
from cloud_aggregator.aggregation.streaming import RoundFold
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.aggregation.weighting import strategy_args
from ioft_protocol.codec import TensorSpec
from trainer_lite.algorithms import ClientAlgorithm, make_client
from trainer_lite.algorithms.base import build_config, client_class
from trainer_lite.client import cast_params
from trainer_lite.params import Params
from trainer_lite.privacy import DPConfig
from trainer_lite.task import TaskSpec


class Strategy(ABC):
    """Base of every server strategy; ``config_cls`` validates ``TaskSpec.server``."""

    name: ClassVar[str]
    config_cls: ClassVar[type]
    #: Whether an upload for the previous round can be mixed into this one (``straggler = "next_round"``,
    #: ``cloud_aggregator.rounds.stragglers``): true where the global is a weighted mean of uploads.
    accepts_late_updates: ClassVar[bool] = False
    #: The DP modes its means support (``strategies.privacy``); empty: a task with ``dp`` is refused.
    dp_modes: ClassVar[tuple[str, ...]] = ()
    #: Whether a SecAgg round can serve it (``cloud_aggregator.serve.secagg_round``): its global is the
    #: plain weighted mean of the uploads, which is all a masked sum reveals.
    secagg: ClassVar[bool] = False
    #: Whether compressed uploads (``[task.compress]``) suit it where it does not fold: its server
    #: combines the decoded parameters by means, as FTL-TP's group means and FedDAR's heads do
    #: (``cloud_aggregator.rounds.task_rules.compress_refusal``).
    compressible: ClassVar[bool] = False

    def __init__(self, spec: TaskSpec, client: ClientAlgorithm | None = None) -> None:
        self.spec = spec
        self.client = client or make_client(spec)
        self.config = build_config(self.config_cls, strategy_args(spec.server))
        self.dp = DPConfig.from_spec(spec.dp)
        #: Set by a strategy in ``dp_modes`` when its task uses DP; its means go through it.
        self.privacy: PrivateMean | None = None
        if self.dp is not None:
            reducer = self.config.reducer if isinstance(self.config, ReducerChoice) else "mean"
            why = dp_refusal(self.name, self.dp_modes, self.dp, reducer)
            if why:
                raise ValueError(why)

    def init_global(self) -> Params:
        """The first global (shared) parameters, from the task seed."""
        rng = np.random.default_rng(self.spec.seed)
        return cast_params(self.client.init_global(rng), self.spec.dtype)

    def phases(self) -> tuple[str, ...]:
        return self.client.phases()

    def expected(self, global_params: Params, phase: str) -> dict[str, TensorSpec]:
        """What an upload for ``phase`` must hold: by default the global's names, shapes, dtype."""
        return {n: TensorSpec(tuple(v.shape), v.dtype.name) for n, v in global_params.items()}

    def downlink(self, global_params: Params, device: str) -> Params | None:
        """A per-device downlink, or ``None`` when every device gets the broadcast."""
        return None

    def downlinks(self, global_params: Params) -> dict[str, Params]:
        """This round's per-device downlinks, for the devices the strategy knows by name.

        The round engine hands them to the fleet, which sends each listed device its own
        parameters in place of ``global_params``.  Empty by default (broadcast only).
        """
        return {}

    def expected_by_device(self, global_params: Params, phase: str) -> dict[str, dict[str, TensorSpec]]:
        """Upload specs for devices whose upload differs from :meth:`expected` (empty by default)."""
        return {}

    def participants(self, round_: int) -> list[str] | None:
        """The devices the server selects for ``round_``; ``None`` leaves sampling to the fleet.

        Uploads from devices outside a selection are rejected before aggregation.
        """
        return None

    @abstractmethod
    def aggregate(
        self, global_params: Params, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        """New global parameters from validated updates (at least one). Never mutates inputs."""

    def fold(self, phase: str) -> RoundFold | None:
        """A fold that takes each admitted upload as it arrives (memory O(P), flat in N), or
        ``None``: this strategy needs all of a round's uploads at once (``cloud_aggregator.aggregation.streaming``)."""
        return None

    def aggregate_folded(
        self, global_params: Params, fold: RoundFold, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        """New global parameters from a round's :meth:`fold`; ``updates`` carry no params (folded)."""
        raise NotImplementedError(f"{type(self).__name__} folds no uploads")

    def stop_reason(self) -> str | None:
        """Why the task must stop before its next round (a spent ε budget); ``None``: go on."""
        return None if self.privacy is None else self.privacy.stop_reason()

    def record_extra(self) -> dict[str, Any]:
        """What the last round's record keeps beyond the engine's fields (``{"dp": ε, δ, ...}``)."""
        return {} if self.privacy is None else {"dp": self.privacy.summary()}

    def state(self) -> dict[str, Any]:
        """Strategy state to persist between rounds beyond the global parameters (JSON-able)."""
        return self.with_dp_state({})

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what ``state`` returned."""
        state = self.load_dp_state(state)
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")

    def with_dp_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` plus the DP ledger's under ``"dp"`` (for ``state`` overrides)."""
        return state if self.privacy is None else {**state, "dp": self.privacy.state()}

    def load_dp_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Restore the DP ledger from ``state["dp"]``; returns the rest (for ``load_state`` overrides)."""
        rest = dict(state)
        dp = rest.pop("dp", None)
        if dp is not None and self.privacy is not None:
            self.privacy.load_state(dp)
        return rest


_STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: register a server strategy under ``cls.name``.

    Which clients it serves is said by the clients: each client algorithm names its
    strategy in ``ClientAlgorithm.server``.
    """
    if cls.name in _STRATEGIES:
        raise ValueError(f"server strategy {cls.name!r} registered twice")
    _STRATEGIES[cls.name] = cls
    return cls


def strategy_class(algorithm: str) -> type[Strategy]:
    """The strategy class that serves client algorithm ``algorithm`` (the one its ``server`` names).

    Raises
    ------
    ValueError
        If ``algorithm`` is not a registered client algorithm (the message lists them),
        or if it names a strategy that is not registered (the message lists those).
    """
    client = client_class(algorithm)
    try:
        return _STRATEGIES[client.server]
    except KeyError:
        raise ValueError(
            f"algorithm {algorithm!r} names server strategy {client.server!r}, which is not registered; "
            f"set {client.__name__}.server to one of {sorted(_STRATEGIES)}"
        ) from None


def make_strategy(spec: TaskSpec) -> Strategy:
    """The server strategy for ``spec.algorithm``: the one its client class names in ``server``."""
    return strategy_class(spec.algorithm)(spec)

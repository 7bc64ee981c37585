"""FTL-TP's client (Eslaminia et al. 2024, Algorithm 1 and eq. 5): task groups sharing a base.

Devices belong to *task groups* (FTL-TP's domain groups, e.g. tool-condition welders
``"M"`` and surface-condition welders ``"T"``), each with its own classes.  Every
group's model is the same MLP up to its last width (FTL-TP: 624-175-125-50-C,
Kaiming-normal, ReLU); the first ``base_layers`` (K_B) linear blocks are shared by
**all** groups, the blocks above them by the devices **of one group**.

Names on the wire
-----------------
The server's global state holds the base under the model's own names
(``fc0.weight``, ``fc0.bias``) and each group's upper blocks under
``group.<g>.<name>`` (``group.M.fc1.weight`` … ``group.M.fc3.bias``).  A device is
sent its per-device downlink (``Strategy.downlinks``): the base plus its own group's
block, nothing else; that is also how it learns which group it is in, so the
task spec is the same for every device.  It uploads exactly the names it was sent.

Local objective (eq. 5)
-----------------------
``CE(θ) + α_L2R·(1/n)Σ‖z_n‖² + μ/2·‖θ − θ_t‖²`` with ``z`` the output of the
last base block after its ReLU (:mod:`trainer_lite.algorithms.fedl2r`), θ_t the
downlinked model; E local epochs of minibatch Adam (a fresh optimiser per round).
Defaults are §5.1's: K_B = 1, α_L2R = 0.001, μ = 0.01, B = 8, η = 5e-4, E = 1.
The device keeps no state between rounds.  L2R is the batch mean of the per-sample
squared norm (eq. 6), added once; a device's round equals torch's Adam on the same
minibatches (tests).  Why it can cost accuracy on an unseen domain even at small α
(the first block is where it acts): :mod:`trainer_lite.algorithms.fedl2r`.  Feed it
standardised features (:mod:`sensors.features.scaling`): the term's weight against
the cross-entropy scales with the input's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer_lite.algorithms.base import ClientAlgorithm, ClientResult, TrainConfig, register_client
from trainer_lite.algorithms.fedl2r import l2r_round, split_after
from trainer_lite.data import Dataset
from trainer_lite.layers import Sequential
from trainer_lite.models import build_model
from trainer_lite.params import Params, copy_params
from trainer_lite.task import TaskSpec

GROUP = "group"


def group_key(group: str, name: str) -> str:
    """The wire name of a group's parameter: ``group.<group>.<name>``."""
    return f"{GROUP}.{group}.{name}"


def group_of_name(name: str) -> str | None:
    """The group a wire name belongs to, or ``None`` for a base name."""
    parts = name.split(".", 2)
    return parts[1] if len(parts) == 3 and parts[0] == GROUP else None


@dataclass(frozen=True)
class FTLTPConfig(TrainConfig):
    """FTL-TP's client settings (defaults: §5.1).

    Attributes
    ----------
    groups
        Task group → number of classes, e.g. ``{"M": 4, "S": 3}``.  Each group's model
        is the task's model with its last width replaced by the group's class count.
    base_layers
        K_B: how many blocks with parameters, from the input, all groups share.
    alpha_l2r
        α_L2R of the representation regulariser on the base output.
    mu
        μ of the proximal term.
    epochs
        Local epochs E (``E·⌈n/B⌉`` steps); ``None`` uses ``local_steps``.
    """

    groups: dict[str, int] = field(default_factory=dict)
    base_layers: int = 1
    alpha_l2r: float = 0.001
    mu: float = 0.01
    epochs: int | None = 1
    lr: float = 5e-4
    batch_size: int | None = 8
    loss: str = "cross_entropy"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.groups:
            raise ValueError('FTL-TP needs hparams["groups"], task group -> classes, e.g. {"M": 4, "S": 3}')
        bad = [g for g in self.groups if not g or "." in g or not all(c.isalnum() or c in "_-" for c in g)]
        if bad:
            raise ValueError(f"group names must be non-empty [A-Za-z0-9_-]+ (no dots), got {bad}")
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in self.groups.values()):
            raise ValueError(f"each group needs a positive integer class count, got {self.groups}")
        if self.base_layers < 1:
            raise ValueError(f"base_layers (K_B) must be >= 1, got {self.base_layers}")
        if self.alpha_l2r < 0 or self.mu < 0:
            raise ValueError(f"alpha_l2r and mu must be >= 0, got {self.alpha_l2r}, {self.mu}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {self.epochs}")


def group_model_args(model_args: dict[str, Any], n_classes: int) -> dict[str, Any]:
    """The task's model arguments with the output width set to ``n_classes``."""
    sizes = model_args.get("sizes")
    if not isinstance(sizes, list | tuple) or len(sizes) < 2:
        raise ValueError(
            "FTL-TP builds one model per task group from model_args['sizes'] "
            f"(e.g. [624, 175, 125, 50, 4]; the last width becomes each group's class count), got {sizes!r}"
        )
    return {**model_args, "sizes": [*sizes[:-1], n_classes]}


@register_client
class FTLTPClient(ClientAlgorithm):
    """A device of one task group: trains base + its group's blocks, uploads both."""

    name = "ftltp"
    server = "ftltp"
    config_cls = FTLTPConfig

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__(spec)
        cfg: FTLTPConfig = self.config
        self.groups = sorted(cfg.groups)
        self.models: dict[str, Sequential] = {
            g: build_model(spec.model, **group_model_args(spec.model_args, cfg.groups[g]))
            for g in self.groups
        }
        self.splits = {g: split_after(m, cfg.base_layers) for g, m in self.models.items()}
        bases = {g: tuple(base.param_names()) for g, (base, _) in self.splits.items()}
        if len(set(bases.values())) != 1:
            raise ValueError(f"the groups' base blocks must have the same parameters, got {bases}")
        self.base_names = sorted(bases[self.groups[0]])
        self.upper_names = {g: sorted(head.param_names()) for g, (_, head) in self.splits.items()}
        self._shapes: dict[str, tuple[int, ...]] | None = None

    # -- names ------------------------------------------------------------
    def shared_names(self) -> list[str]:
        """The server's state: the base and every group's upper blocks (a device sends a subset)."""
        return self.base_names + [group_key(g, n) for g in self.groups for n in self.upper_names[g]]

    def names_for(self, group: str) -> list[str]:
        """What a device of ``group`` is sent and uploads."""
        if group not in self.upper_names:
            raise ValueError(f"unknown task group {group!r}; groups are {self.groups}")
        return self.base_names + [group_key(group, n) for n in self.upper_names[group]]

    def group_of(self, shared: Params) -> str:
        """The one task group a downlink is for; raises ``ValueError`` otherwise."""
        found = sorted({g for n in shared if (g := group_of_name(n)) is not None})
        if len(found) != 1:
            raise ValueError(
                f"an FTL-TP device trains one task group, but the downlink holds groups {found}; send it "
                "the strategy's per-device downlink (base + its group's blocks)"
            )
        return found[0]

    def init_global(self, rng: np.random.Generator) -> Params:
        """θ_B⁰ once, then θ_Pg⁰ for every group in sorted order (Algorithm 1, line 2)."""
        out: Params = {}
        for g in self.groups:
            full = self.models[g].init(rng)
            if not out:
                out.update({n: full[n] for n in self.base_names})
            out.update({group_key(g, n): full[n] for n in self.upper_names[g]})
        return out

    def check_shared(self, shared: Params, phase: str) -> None:
        group = self.group_of(shared)
        if self._shapes is None:
            self._shapes = {n: v.shape for n, v in self.init_global(np.random.default_rng(0)).items()}
        expected = self.names_for(group)
        if set(shared) != set(expected):
            raise ValueError(
                f"downlink for group {group!r} differs: missing {sorted(set(expected) - set(shared))}, "
                f"unexpected {sorted(set(shared) - set(expected))}"
            )
        for n in expected:
            arr = np.asarray(shared[n])
            if arr.shape != self._shapes[n]:
                raise ValueError(f"downlink {n!r} has shape {arr.shape}, expected {self._shapes[n]}")
            if not np.isfinite(arr).all():
                raise ValueError(f"downlink {n!r} holds NaN or Inf")

    # -- device state -----------------------------------------------------
    def init_local(self, rng: np.random.Generator) -> Params:
        return {}

    def personal_params(self, shared: Params, local: Params) -> Params:
        """The group model's parameters under its own names (``fc0.weight`` … ``fc3.bias``)."""
        group = self.group_of(shared)
        out = {n: shared[n] for n in self.base_names}
        out.update({n: shared[group_key(group, n)] for n in self.upper_names[group]})
        return out

    def predict(self, shared: Params, local: Params, x: np.ndarray) -> np.ndarray:
        return self.models[self.group_of(shared)](self.personal_params(shared, local), x)

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
        cfg: FTLTPConfig = self.config
        group = self.group_of(shared)
        anchor = self.personal_params(shared, local)
        params = copy_params(anchor)
        base, head = self.splits[group]
        metrics = l2r_round(base, head, params, data, self.loss, cfg, rng, round_=round_, anchor=anchor)
        upload = {n: params[n] for n in self.base_names}
        upload.update({group_key(group, n): params[n] for n in self.upper_names[group]})
        return ClientResult(upload, len(data), metrics), {}

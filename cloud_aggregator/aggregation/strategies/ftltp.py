"""FTL-TP's server (Eslaminia et al. 2024, Algorithm 1): one base over all groups, upper blocks per group.

Each round the server picks ``max(1, round(C_g·M_g))`` devices of every task group g
(line 4), sends each the base plus its group's upper blocks (line 5: a per-device
downlink), then averages, weighted by sample counts,

* the base over **all** uploads: ``θ_B ← Σ_k n_k θ_B(k) / Σ_k n_k`` (lines 12-15);
* group g's blocks over the uploads **of group g** only (lines 16-17).

Both means go through the configured reducer (``server.reducer``, as FedAvg's), so
the robust rules apply to the base over all uploads and to each group's blocks.

A group with no upload this round keeps its blocks.  The device → group map is
``TaskSpec.server["device_groups"]``; names are as in
:mod:`trainer_lite.algorithms.ftltp` (base under the model's names,
``group.<g>.*`` above it).

The FL baselines of the paper's comparison need no server of their own: FedAvg,
FedProx and FedL2R are all FedAvg's weighted mean (their clients name ``server = "fedavg"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cloud_aggregator.aggregation.reducers import Reducer, ReducerChoice, get_reducer
from cloud_aggregator.aggregation.strategies.base import Strategy, TensorSpec, register_strategy
from cloud_aggregator.aggregation.strategies.privacy import PrivateMean
from cloud_aggregator.aggregation.update import Update
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.algorithms.ftltp import FTLTPClient
from trainer_lite.client import derive_rng
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec


@dataclass(frozen=True)
class FTLTPServerConfig(ReducerChoice):
    """FTL-TP's server settings.

    Attributes
    ----------
    device_groups
        Device id → task group (a key of the client's ``hparams["groups"]``).
    client_fraction
        C, one fraction for every group or one per group (``{"M": 1/3, "S": 1/3}``);
        each round ``max(1, round(C_g·M_g))`` of group g's M_g devices take part.
    """

    device_groups: dict[str, str] = field(default_factory=dict)
    client_fraction: float | dict[str, float] = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.device_groups:
            raise ValueError('FTL-TP needs server["device_groups"], device id -> task group')
        fractions = (
            self.client_fraction.values()
            if isinstance(self.client_fraction, dict)
            else [self.client_fraction]
        )
        if any(not 0.0 < float(c) <= 1.0 for c in fractions):
            raise ValueError(f"client_fraction must lie in (0, 1], got {self.client_fraction}")


def group_means(
    updates: Sequence[Update],
    groups: dict[str, str],
    base: list[str],
    reduce: Reducer | None = None,
    global_params: Params | None = None,
) -> tuple[Params, dict[str, Params]]:
    """Algorithm 1, lines 12-17: the sample-weighted base over all updates and each group's own mean.

    ``reduce`` (default: the weighted mean) combines each set, with ``global_params`` as the
    reference robust reducers measure changes from.  Returns ``(base mean, {group: that
    group's mean of its own names})``; pure, no state.
    """
    reduce = reduce or get_reducer("mean")
    g = global_params or {}
    base_mean = reduce(g, [({n: u.params[n] for n in base}, float(u.n_samples)) for u in updates])
    by_group: dict[str, list[Update]] = {}
    for u in updates:
        by_group.setdefault(groups[u.device], []).append(u)
    base_set = set(base)
    uppers = {
        grp: reduce(
            g, [({n: v for n, v in u.params.items() if n not in base_set}, float(u.n_samples)) for u in us]
        )
        for grp, us in by_group.items()
    }
    return base_mean, uppers


@register_strategy
class FTLTP(Strategy):
    name = "ftltp"
    config_cls = FTLTPServerConfig
    #: Distributed noise would need each device to add a share per mean it joins (base and its
    #: group's blocks, each over its own count); only central noise is offered.
    dp_modes = ("central",)
    compressible = True  # the base and each group's blocks are means of the decoded uploads

    def __init__(self, spec: TaskSpec, client: ClientAlgorithm | None = None) -> None:
        super().__init__(spec, client)
        if not isinstance(self.client, FTLTPClient):
            raise ValueError(f"the FTL-TP server needs the 'ftltp' client, got {type(self.client).__name__}")
        cfg: FTLTPServerConfig = self.config
        unknown = sorted({g for g in cfg.device_groups.values() if g not in self.client.groups})
        if unknown:
            raise ValueError(
                f"device_groups names groups {unknown} that hparams['groups'] lacks; have {self.client.groups}"
            )
        self.members: dict[str, list[str]] = {g: [] for g in self.client.groups}
        for device in sorted(cfg.device_groups):
            self.members[cfg.device_groups[device]].append(device)
        fr = cfg.client_fraction
        if isinstance(fr, dict) and (missing := sorted(set(self.client.groups) - set(fr))):
            raise ValueError(
                f"client_fraction has no entry for groups {missing}; give one per group or a number"
            )
        self.fraction = {g: float(fr[g]) if isinstance(fr, dict) else float(fr) for g in self.client.groups}
        self.picks = {g: self._picks(g) for g in self.client.groups}
        if self.dp is not None:
            if self.dp.devices_per_round is not None or self.dp.fleet_size is not None:
                raise ValueError(
                    "dp with the ftltp server: leave devices_per_round and fleet_size out; it counts each "
                    "group's devices per round from device_groups and client_fraction"
                )
            # A device's chance to be drawn: the largest of its group's C_g (conservative).
            rate = max(k / len(self.members[g]) for g, k in self.picks.items() if k)
            self.privacy = PrivateMean(self.dp, rate)

    def _picks(self, group: str) -> int:
        """How many of ``group``'s devices a round draws: ``max(1, round(C_g·M_g))``, at most M_g."""
        devices = self.members[group]
        return min(len(devices), max(1, round(self.fraction[group] * len(devices)))) if devices else 0

    def downlink(self, global_params: Params, device: str) -> Params | None:
        """The base plus the device's group's blocks; ``None`` for a device in no group."""
        group = self.config.device_groups.get(device)
        if group is None:
            return None
        return {n: global_params[n] for n in self.client.names_for(group)}

    def downlinks(self, global_params: Params) -> dict[str, Params]:
        return {d: self.downlink(global_params, d) for d in self.config.device_groups}

    def expected_by_device(self, global_params: Params, phase: str) -> dict[str, dict[str, TensorSpec]]:
        per_group = {
            g: {
                n: TensorSpec(tuple(global_params[n].shape), global_params[n].dtype.name)
                for n in self.client.names_for(g)
            }
            for g in self.client.groups
        }
        return {d: per_group[g] for d, g in self.config.device_groups.items()}

    def participants(self, round_: int) -> list[str] | None:
        """``max(1, round(C_g·M_g))`` devices of each group, drawn from the task seed and the round."""
        chosen: list[str] = []
        for g in self.client.groups:
            devices = self.members[g]
            k = self.picks[g]
            if k >= len(devices):
                chosen.extend(devices)
            elif k:
                rng = derive_rng(self.spec.seed, "participation", g, round_)
                chosen.extend(rng.choice(devices, size=k, replace=False).tolist())
        return sorted(chosen)

    def aggregate(
        self, global_params: Params, updates: Sequence[Update], *, round_: int, phase: str
    ) -> Params:
        groups = self.config.device_groups
        strangers = sorted(u.device for u in updates if u.device not in groups)
        if strangers:
            raise ValueError(f"updates from devices in no task group: {strangers}; add them to device_groups")
        if self.privacy is not None:
            return self._private_means(global_params, updates, round_)
        base, uppers = group_means(
            updates, groups, self.client.base_names, self.config.make_reducer(), global_params
        )
        out = dict(global_params)  # groups nobody uploaded for keep their blocks
        out.update(base)
        for block in uppers.values():
            out.update(block)
        return out

    def _private_means(self, global_params: Params, updates: Sequence[Update], round_: int) -> Params:
        """DP-FedAvg's noisy means: each upload clipped over base and blocks jointly (sensitivity C),
        noise σ = z·C on the base sum and on each group's sum, fixed denominators (the picks)."""
        assert self.privacy is not None
        uploads = self.privacy.clip_jointly(global_params, [u.params for u in updates])
        base = self.client.base_names
        expected = sum(self.picks.values())
        out = dict(global_params)  # groups nobody uploaded for keep their blocks
        out.update(
            self.privacy.mean(
                global_params, [{n: p[n] for n in base} for p in uploads], expected, clipped=True
            )
        )
        blocks: dict[str, list[Params]] = {}
        base_set = set(base)
        for u, p in zip(updates, uploads, strict=True):
            blocks.setdefault(self.config.device_groups[u.device], []).append(
                {n: v for n, v in p.items() if n not in base_set}
            )
        for group, ps in sorted(blocks.items()):
            out.update(self.privacy.mean(global_params, ps, self.picks[group], clipped=True))
        self.privacy.release(self.spec.name, round_, len(updates), expected)
        return out

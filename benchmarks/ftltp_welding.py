"""FTL-TP §5 (Eslaminia et al. 2024) on simulated ultrasonic welds: accuracy on an unseen target domain.

``python -m benchmarks.ftltp_welding [--study main unbalanced fraction] [--seeds 0 1 2 3 4] [--rounds N] [--quick]``

Data: :func:`sensors.sim.weld_groups.simulate_domain_group` welds through the 624-feature
DWT recipe (``sensors.features``): group **M** (4 material domains × 200 welds, tool
classes TC1-TC4), **S** (3 surface domains × 90, tool classes New/Worn/DMGD) and
**T** (the S welds, surface classes, tool-condition domains).  Welds are simulated
once (``--data-seed``) at ``time_scale`` 0.3 (slow dynamics compressed; carrier and
bursts unchanged); repeats redraw the client split and the initialisation.

Protocol (§5.1): in each group one target domain is held out and never seen; every
source domain is split at random over 3 clients (9 clients in M, 6 in S or T).
Pairings M+S and M+T.  Features are standardised (``--standardize``, the same
transform for every method, :class:`sensors.features.scaling.Standardizer`):

* ``fleet`` (default): what a device can do, the task's ``scaling = "fleet"`` through the
  same code: each client of the task sends ``(n, Σx, Σx²)``, the transform is pooled by
  :func:`sensors.features.scaling.pool_feature_sums` (the aggregator's call; the federated
  methods run it inside :class:`~cloud_aggregator.rounds.simulation.SimulatedFleet`), and the
  unseen target domain, a device that joins later, goes through the published transform.
  The task's clients are FTL-TP's both groups (one task) and a baseline's one group; the
  centralised references (IL, CL, CTL) pool their group's clients the same way.
* ``group``: per group, with the mean and standard deviation of that group's source clients
  pooled centrally, whatever the method (for FTL-TP not what its one task could pool).
* ``client``: every client with its own rows' statistics (local, nothing shared),
  and the target domain with its own (unlabelled) statistics, as a new welder would
  standardise its own welds; a labelled variant, not the paper's protocol.
* ``none``: raw DWT features (a task without ``scaling``; ``scaling = "local"`` makes each
  device z-score its own rows, as ``client`` does here): per-feature scales from ~1e-8 to ~100, ‖x‖² ~ 1e5.  Methods on the same 624-175-125-50-C
MLP (Kaiming-normal, ReLU, Adam, cross-entropy, B = 8, η = 5e-4, E = 1):

* **FTL-TP**: K_B = 1 shared by both groups, upper blocks per group, α_L2R = 0.001,
  μ = 0.01 (``ftltp`` client and server, the one RoundEngine).
* **FedAvg**, **FedProx** (μ = 0.1), **FedL2R** (α = 0.01 on the penultimate
  output, FedSR's representation): one group's clients alone.
* **IL** (mean over the group's clients, each alone), **CL** (the group's source
  clients pooled), **CTL** (pooled partner group, then base frozen and the upper
  blocks fine-tuned on the pooled group): in-process references.
* **FTL-TP α=0**, our ablation: FTL-TP without the L2R term (task-group sharing and
  the proximal term only).

Every method trains ``--rounds`` rounds (federated) or epochs (centralised; CTL as
many again to fine-tune).  The paper uses 150; the default, 30, fits the main study of
two repeats in about 12 minutes on 2 loaded cores.  By round 30 the baselines' target
accuracy has settled, while FTL-TP's in group M peaks near round 16 and then falls (the
``_curves.png`` plot); ``--rounds 150`` runs the paper's length and writes
``ftltp_welding_r150.*``.  The welds' domain shift includes a physical one (the tool's
wear signature changes DWT band with material and surface, :mod:`sensors.sim.welder`;
``benchmarks.welder_bands`` tabulates it), besides per-feature offsets and gains.  Partner targets: the
paper runs every partner target for every target (3-4 runs per target per repeat); we
rotate the partner with the repeat (target i of M meets target (i + repeat) mod 3 of
S/T), so each repeat costs 4 FTL-TP runs per pairing.

Studies: ``main`` (all methods, both pairings), ``unbalanced`` (M+S, FTL-TP with
30/60/110 welds per M source domain and 15/25/50 in one S source domain) and
``fraction`` (M+S, FTL-TP with client fraction C = 1/3, 2/3 per group, against C = 1).
"""

from __future__ import annotations

import os

# One BLAS thread per worker process: the GEMMs are small and the cores are few.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import math
import multiprocessing as mp
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    RESULTS,
    markdown_table,
    mean_std,
    progress,
    study_parser,
    write_result,
)
from cloud_aggregator.rounds.simulation import ClientData, simulate
from sensors.features.scaling import Standardizer, feature_sums, pool_feature_sums
from sensors.sim.weld_groups import simulate_domain_group
from sensors.sim.welder import SURFACES
from trainer_lite.algorithms.base import MIN_POOL_DEVICES, get_loss
from trainer_lite.algorithms.centralised import centralised_transfer, train_centralised
from trainer_lite.data import Dataset
from trainer_lite.models import mlp
from trainer_lite.task import TaskSpec

HIDDEN = [624, 175, 125, 50]
NO_L2R = "FTL-TP α=0"  # our ablation: FTL-TP without the L2R term
METHODS = ("IL", "CL", "CTL", "FedAvg", "FedProx", "FedL2R", NO_L2R, "FTL-TP")
FL_ALGOS = {"FedAvg": "fedavg", "FedProx": "fedprox", "FedL2R": "fedl2r"}
PAIRINGS = (("M", "S"), ("M", "T"))
STUDIES = ("main", "unbalanced", "fraction")
STANDARDIZE = ("fleet", "group", "client", "none")
FRACTIONS = {"C=1/3": 1 / 3, "C=2/3": 2 / 3}
DOMAIN_ABBREV = {"Al-Cu": "AC", "Cu-Cu": "CC", "Cu-Al": "CA", "Al-Al": "AA"}
#: §5.2-5.3 and abstract: FTL-TP's average accuracy gain over each method (percentage points).
PAPER_GAIN = {"FedAvg": 8.08, "FedProx": 7.19, "FedL2R": 5.35, "IL": 20.83, "CL": 5.44, "CTL": 3.84}


@dataclass(frozen=True)
class GroupData:
    """One domain group's welds as features: ``y`` into ``classes``, ``domain`` into ``domains``."""

    name: str
    X: np.ndarray
    y: np.ndarray
    domain: np.ndarray
    classes: tuple[str, ...]
    domains: tuple[str, ...]


@dataclass(frozen=True)
class Config:
    """Sizes and hyperparameters of one study run (defaults: §5.1 except ``rounds``)."""

    n_m: int = 200
    n_s: int = 90
    time_scale: float = 0.3
    data_seed: int = 0
    rounds: int = 30
    eval_every: int = 2
    lr: float = 5e-4
    batch: int = 8
    base_layers: int = 1
    alpha_ftltp: float = 0.001
    mu_ftltp: float = 0.01
    mu_fedprox: float = 0.1
    alpha_fedl2r: float = 0.01
    clients_per_domain: int = 3
    unbalanced_m: tuple[int, ...] = (30, 60, 110)
    unbalanced_s: tuple[int, ...] = (15, 25, 50)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    studies: tuple[str, ...] = STUDIES
    methods: tuple[str, ...] = METHODS
    workers: int = 2
    standardize: str = "fleet"


def quick_config() -> Config:
    """Small data and few rounds: the test suite's run (well under a minute on 2 idle cores)."""
    return Config(
        n_m=40,
        n_s=24,
        rounds=20,
        eval_every=5,
        seeds=(0, 1),
        unbalanced_m=(6, 12, 22),
        unbalanced_s=(4, 7, 13),
        workers=1,  # the test runs it in its own process: no pool (a forked one hung under load)
    )


def method_means(cells: dict, groups: dict[str, GroupData]) -> dict[str, float]:
    """Each method's accuracy in the main study, averaged over all 14 target rows (equal weight)."""
    out = {}
    for m in METHODS:
        per_row = [
            np.mean(v)
            for lab, g, t in target_rows(groups, PAIRINGS)
            if (v := cells.get(("main", m, lab, g, t)))
        ]
        if per_row:
            out[m] = float(np.mean(per_row))
    return out


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


def _simulate(args: tuple[str, int, int, float]) -> tuple[str, Any]:
    group, n, seed, time_scale = args
    return group, simulate_domain_group(group, n, seed=seed, time_scale=time_scale)


def load_groups(cfg: Config) -> dict[str, GroupData]:
    """M and S from the simulator (in parallel), T as the S welds relabelled (same signals)."""
    jobs = [("M", cfg.n_m, cfg.data_seed, cfg.time_scale), ("S", cfg.n_s, cfg.data_seed + 1, cfg.time_scale)]
    if cfg.workers > 1:
        with mp.get_context("spawn").Pool(2, initializer=single_blas_thread) as pool:
            sims = dict(pool.map(_simulate, jobs))
    else:
        sims = dict(map(_simulate, jobs))
    m, s = sims["M"], sims["S"]
    return {
        "M": GroupData("M", m.X, m.y, m.domain, m.classes, tuple(DOMAIN_ABBREV.get(d, d) for d in m.domains)),
        "S": GroupData("S", s.X, s.y, s.domain, s.classes, tuple(d.capitalize()[:8] for d in s.domains)),
        "T": GroupData("T", s.X, s.surface, s.tool, SURFACES, s.tool_classes),
    }


def split_sizes(n: int, k: int, sizes: Sequence[int] | None) -> list[int]:
    """``k`` near-equal client sizes summing to ``n``, or ``sizes`` (which must sum to ``n``)."""
    if sizes is None:
        return [len(part) for part in np.array_split(np.arange(n), k)]
    if sum(sizes) != n:
        raise ValueError(f"client sizes {list(sizes)} must add up to the domain's {n} welds")
    return list(sizes)


@dataclass
class Split:
    """A group's clients (standardised features) and its unseen target domain."""

    clients: dict[str, Dataset]
    target: Dataset
    n_classes: int

    def pooled(self) -> Dataset:
        return Dataset(
            np.concatenate([d.x for d in self.clients.values()]),
            np.concatenate([d.y for d in self.clients.values()]),
        )


def make_split(
    data: GroupData, target: int, seed: int, cfg: Config, sizes: dict[int, Sequence[int]] | None = None
) -> Split:
    """Hold out domain ``target``; split each source domain at random over ``cfg.clients_per_domain`` clients.

    ``sizes`` maps a source domain's rank (0 = first source domain) to its client sizes.
    Features are standardised as ``cfg.standardize`` says (module docstring).
    """
    if cfg.standardize not in STANDARDIZE:
        raise ValueError(f"standardize must be one of {STANDARDIZE}, got {cfg.standardize!r}")
    rng = np.random.default_rng([seed, target, ord(data.name)])
    src = data.domain != target
    if cfg.standardize == "group":
        Z = Standardizer.fit(data.X[src]).transform(data.X)
    else:  # fleet: raw here, scaled by the task's pooled transform (fleet_scaled, SimulatedFleet)
        Z = data.X.astype(np.float32)

    def rows(part: np.ndarray) -> Dataset:
        x = Standardizer.fit(data.X[part]).transform(data.X[part]) if cfg.standardize == "client" else Z[part]
        return Dataset(x, data.y[part])

    clients: dict[str, Dataset] = {}
    for rank, dom in enumerate(d for d in range(len(data.domains)) if d != target):
        idx = rng.permutation(np.flatnonzero(data.domain == dom))
        bounds = np.cumsum([0, *split_sizes(len(idx), cfg.clients_per_domain, (sizes or {}).get(rank))])
        for k in range(cfg.clients_per_domain):
            part = np.sort(idx[bounds[k] : bounds[k + 1]])
            clients[f"{data.name.lower()}-{data.domains[dom].lower()}-{k}"] = rows(part)
    return Split(clients, rows(np.flatnonzero(~src)), len(data.classes))


def fleet_scaled(split: Split, cfg: Config) -> Split:
    """``split`` through its clients' pooled transform where ``cfg.standardize == "fleet"`` (the
    centralised references: their group's clients are the fleet); otherwise unchanged."""
    if cfg.standardize != "fleet":
        return split
    scaler = pool_feature_sums({c: feature_sums(d.x) for c, d in split.clients.items()}, MIN_POOL_DEVICES)
    clients = {c: Dataset(scaler.transform(d.x), d.y) for c, d in split.clients.items()}
    return Split(clients, Dataset(scaler.transform(split.target.x), split.target.y), split.n_classes)


def fleet_hparams(cfg: Config) -> dict[str, Any]:
    """The task hyperparameter that makes the simulated fleet pool and apply the transform."""
    return {"scaling": "fleet"} if cfg.standardize == "fleet" else {}


def target_transform(fleet: Any) -> Any:
    """Rows as the task's model takes them: through the fleet's published transform, if any."""
    scaler = getattr(fleet, "fleet_scaler", None)
    return (lambda x: x) if scaler is None else scaler.transform


def unbalanced_sizes(group: str, cfg: Config, n_source_domains: int) -> dict[int, Sequence[int]]:
    """§5.4: every M source domain 30/60/110; the first S source domain 15/25/50, the rest even."""
    if group == "M":
        return dict.fromkeys(range(n_source_domains), cfg.unbalanced_m)
    return {0: cfg.unbalanced_s}


# ---------------------------------------------------------------------------------------
# Methods: each returns target accuracy (and a curve of it for the federated ones)
# ---------------------------------------------------------------------------------------

_GROUPS: dict[str, GroupData] = {}  # set in each worker (run_study, _init_worker)


def _fl_spec(algorithm: str, n_classes: int, seed: int, cfg: Config, **extra: Any) -> TaskSpec:
    hp: dict[str, Any] = {"lr": cfg.lr, "batch_size": cfg.batch, "loss": "cross_entropy", **extra}
    return TaskSpec(
        name="weld",
        algorithm=algorithm,
        model="mlp",
        model_args={"sizes": [*HIDDEN, n_classes], "init": "kaiming"},
        hparams=hp,
        rounds=cfg.rounds,
        seed=seed,
    )


def run_ftltp(
    pairing: tuple[str, str], targets: tuple[int, int], seed: int, cfg: Config, variant: str = "balanced"
) -> dict[str, Any]:
    """One FTL-TP run over both groups.

    ``variant``: ``balanced``, ``unbalanced``, ``C=1/3``/``C=2/3`` (client fraction) or
    ``no-l2r`` (balanced, α_L2R = 0).
    """
    splits = {}
    for g, t in zip(pairing, targets, strict=True):
        data = _GROUPS[g]
        sizes = unbalanced_sizes(g, cfg, len(data.domains) - 1) if variant == "unbalanced" else None
        splits[g] = make_split(data, t, seed, cfg, sizes)
    clients = {c: ClientData(d) for g in pairing for c, d in splits[g].clients.items()}
    spec = TaskSpec(
        name="weld",
        algorithm="ftltp",
        model="mlp",
        # The last width is replaced by each group's class count.
        model_args={"sizes": [*HIDDEN, splits[pairing[0]].n_classes], "init": "kaiming"},
        hparams={
            "groups": {g: splits[g].n_classes for g in pairing},
            "base_layers": cfg.base_layers,
            "alpha_l2r": 0.0 if variant == "no-l2r" else cfg.alpha_ftltp,
            "mu": cfg.mu_ftltp,
            "epochs": 1,
            "lr": cfg.lr,
            "batch_size": cfg.batch,
            **fleet_hparams(cfg),
        },
        server={
            "device_groups": {c: g for g in pairing for c in splits[g].clients},
            "client_fraction": FRACTIONS.get(variant, 1.0),
        },
        rounds=cfg.rounds,
        seed=seed,
    )
    curves: dict[str, list[float]] = {g: [] for g in pairing}

    def score(fleet, global_params) -> dict[str, float]:
        algo, tx = fleet.algo, target_transform(fleet)
        return {
            g: algo.evaluate(
                {n: global_params[n] for n in algo.names_for(g)},
                {},
                Dataset(tx(splits[g].target.x), splits[g].target.y),
            )["accuracy"]
            for g in pairing
        }

    def on_record(rec, fleet, global_params) -> None:
        if rec.round % cfg.eval_every == 0:
            for g, acc in score(fleet, global_params).items():
                curves[g].append(acc)

    final, fleet, records = simulate(spec, clients, on_record=on_record)
    # The last round's training loss and representation size, per group (the mechanism table),
    # and mean‖z‖² of the final global base on the group's source rows and on its unseen target.
    last = records[-1].metrics
    train = {
        g: {
            k: float(np.mean([m[k] for d, m in last.items() if d in splits[g].clients]))
            for k in ("train_loss", "z_sq")
        }
        for g in pairing
    }
    tx = target_transform(fleet)
    for g in pairing:
        base = fleet.algo.splits[g][0]
        params = {n: final[n] for n in fleet.algo.base_names}
        train[g]["z_sq_source"] = _mean_sq(base(params, tx(splits[g].pooled().x)))
        train[g]["z_sq_target"] = _mean_sq(base(params, tx(splits[g].target.x)))
    return {"acc": score(fleet, final), "curves": curves, "train": train}


def _mean_sq(z: np.ndarray) -> float:
    """mean over rows of ‖z_n‖²."""
    z = np.asarray(z, dtype=np.float64)
    return float(np.vdot(z, z)) / len(z)


def run_fl(method: str, group: str, target: int, seed: int, cfg: Config) -> dict[str, Any]:
    """FedAvg, FedProx or FedL2R on one group's clients (E = 1)."""
    split = make_split(_GROUPS[group], target, seed, cfg)
    steps = max(math.ceil(len(d) / cfg.batch) for d in split.clients.values())
    extra: dict[str, Any] = {"local_steps": steps}
    if method == "FedProx":
        extra["mu"] = cfg.mu_fedprox
    elif method == "FedL2R":
        extra = {"epochs": 1, "alpha_l2r": cfg.alpha_fedl2r}
    spec = _fl_spec(FL_ALGOS[method], split.n_classes, seed, cfg, **extra, **fleet_hparams(cfg))
    curve: list[float] = []

    def accuracy(fleet, global_params) -> float:
        target = Dataset(target_transform(fleet)(split.target.x), split.target.y)
        return fleet.algo.evaluate(global_params, {}, target)["accuracy"]

    def on_record(rec, fleet, global_params) -> None:
        if rec.round % cfg.eval_every == 0:
            curve.append(accuracy(fleet, global_params))

    final, fleet, _ = simulate(
        spec, {c: ClientData(d) for c, d in split.clients.items()}, on_record=on_record
    )
    return {"acc": {group: accuracy(fleet, final)}, "curves": {group: curve}}


def _accuracy(model, params, data: Dataset) -> float:
    return float(np.mean(np.argmax(model(params, data.x), axis=1) == data.y))


def run_central(method: str, group: str, target: int, seed: int, cfg: Config) -> dict[str, Any]:
    """IL (mean accuracy of the group's clients, each trained alone) or CL (pooled)."""
    split = fleet_scaled(make_split(_GROUPS[group], target, seed, cfg), cfg)
    model = mlp([*HIDDEN, split.n_classes], init="kaiming")
    rng = np.random.default_rng([seed, target, 7])
    kw = {"epochs": cfg.rounds, "batch_size": cfg.batch, "lr": cfg.lr, "rng": rng}
    loss = get_loss("cross_entropy")
    sets = list(split.clients.values()) if method == "IL" else [split.pooled()]
    accs = []
    for data in sets:
        params, _ = train_centralised(model, model.init(rng, dtype=np.float32), data, loss, **kw)
        accs.append(_accuracy(model, params, split.target))
    return {"acc": {group: float(np.mean(accs))}}


def run_ctl(source: tuple[str, int], target: tuple[str, int], seed: int, cfg: Config) -> dict[str, Any]:
    """CTL: pooled source group, base frozen, fine-tuned on the target group's pooled sources."""
    src = fleet_scaled(make_split(_GROUPS[source[0]], source[1], seed, cfg), cfg)
    tgt = fleet_scaled(make_split(_GROUPS[target[0]], target[1], seed, cfg), cfg)
    tgt_model = mlp([*HIDDEN, tgt.n_classes], init="kaiming")
    params = centralised_transfer(
        mlp([*HIDDEN, src.n_classes], init="kaiming"),
        tgt_model,
        src.pooled(),
        tgt.pooled(),
        get_loss("cross_entropy"),
        base_layers=cfg.base_layers,
        epochs=cfg.rounds,
        batch_size=cfg.batch,
        lr=cfg.lr,
        rng=np.random.default_rng([seed, source[1], target[1], 11]),
    ).target
    return {"acc": {target[0]: _accuracy(tgt_model, params, tgt.target)}}


# ---------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One training run; ``rows`` says which table cells its accuracies fill."""

    kind: str  # "ftltp", "fl", "il", "cl", "ctl"
    study: str
    method: str
    args: tuple
    rows: tuple[tuple[str, str, int], ...]  # (pairing label, group, target) per returned accuracy
    cost: float = 1.0


def jobs_for(cfg: Config, groups: dict[str, GroupData]) -> list[Job]:
    """Every run the chosen studies need, costliest first (for load balance)."""
    jobs: list[Job] = []
    n_dom = {g: len(d.domains) for g, d in groups.items()}
    size = {g: len(d.y) for g, d in groups.items()}
    for r, seed in enumerate(cfg.seeds):
        combos = [(p, (i, (i + r) % n_dom[p[1]])) for p in PAIRINGS for i in range(n_dom["M"])]
        for pairing, targets in combos:
            label = "+".join(pairing)
            rows = tuple((label, g, t) for g, t in zip(pairing, targets, strict=True))
            cost = sum(size[g] for g in pairing)
            if "main" in cfg.studies and "FTL-TP" in cfg.methods:
                jobs.append(Job("ftltp", "main", "FTL-TP", (pairing, targets, seed, "balanced"), rows, cost))
            if "main" in cfg.studies and NO_L2R in cfg.methods:
                jobs.append(Job("ftltp", "main", NO_L2R, (pairing, targets, seed, "no-l2r"), rows, cost))
            if "main" in cfg.studies and "CTL" in cfg.methods:
                a, b = zip(pairing, targets, strict=True)
                jobs.append(Job("ctl", "main", "CTL", (b, a, seed), (rows[0],), cost))
                jobs.append(Job("ctl", "main", "CTL", (a, b, seed), (rows[1],), cost))
            if pairing == ("M", "S") and "unbalanced" in cfg.studies:
                jobs.append(
                    Job("ftltp", "unbalanced", "FTL-TP", (pairing, targets, seed, "unbalanced"), rows, cost)
                )
            if pairing == ("M", "S") and "fraction" in cfg.studies:
                for variant, c in FRACTIONS.items():
                    jobs.append(
                        Job("ftltp", variant, "FTL-TP", (pairing, targets, seed, variant), rows, cost * c)
                    )
        if "main" not in cfg.studies:
            continue
        for g in ("M", "S", "T"):
            for t in range(n_dom[g]):
                row = (("*", g, t),)
                for m in ("FedAvg", "FedProx", "FedL2R"):
                    if m in cfg.methods:
                        jobs.append(Job("fl", "main", m, (m, g, t, seed), row, size[g]))
                for m in ("IL", "CL"):
                    if m in cfg.methods:
                        jobs.append(Job(m.lower(), "main", m, (m, g, t, seed), row, size[g]))
    # The balanced FTL-TP runs are also the unbalanced and fraction studies' reference.
    if "main" not in cfg.studies and ({"unbalanced", "fraction"} & set(cfg.studies)):
        for r, seed in enumerate(cfg.seeds):
            for i in range(n_dom["M"]):
                targets = (i, (i + r) % n_dom["S"])
                rows = (("M+S", "M", targets[0]), ("M+S", "S", targets[1]))
                jobs.append(
                    Job(
                        "ftltp",
                        "main",
                        "FTL-TP",
                        (("M", "S"), targets, seed, "balanced"),
                        rows,
                        size["M"] + size["S"],
                    )
                )
    return sorted(jobs, key=lambda j: -j.cost)


def single_blas_thread() -> None:
    """One BLAS thread in this process, even if NumPy was loaded before our environment variables.

    Two workers on two cores, each with a multi-threaded BLAS on these small GEMMs,
    run several times slower (under pytest NumPy is imported before this module).
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # without it, OPENBLAS_NUM_THREADS above is all we can do
        return
    threadpool_limits(1)


def run_job(job: Job) -> tuple[Job, dict[str, Any], float]:
    started = time.perf_counter()
    if job.kind == "ftltp":
        out = run_ftltp(*job.args[:3], _CFG, variant=job.args[3])
    elif job.kind == "fl":
        out = run_fl(*job.args, _CFG)
    elif job.kind in ("il", "cl"):
        out = run_central(*job.args, _CFG)
    else:
        out = run_ctl(*job.args, _CFG)
    return job, out, time.perf_counter() - started


_CFG = Config()


def _init_worker(cfg: Config, groups: dict[str, GroupData]) -> None:
    """A spawned worker: the study's config and data (a forked one inherited them)."""
    global _CFG
    _CFG = cfg
    _GROUPS.clear()
    _GROUPS.update(groups)
    single_blas_thread()


def run_study(
    cfg: Config, groups: dict[str, GroupData] | None = None
) -> list[tuple[Job, dict[str, Any], float]]:
    """Run every job of ``cfg`` in ``cfg.workers`` spawned processes; returns ``(job, output, seconds)``."""
    global _CFG
    _CFG = cfg
    _GROUPS.clear()
    _GROUPS.update(groups if groups is not None else load_groups(cfg))
    jobs = jobs_for(cfg, _GROUPS)
    if cfg.workers <= 1:
        single_blas_thread()
        return [run_job(j) for j in progress(jobs, "ftltp runs", total=len(jobs))]
    # spawn, not fork (a forked pool deadlocked under load): each worker gets the data once
    with mp.get_context("spawn").Pool(
        cfg.workers, initializer=_init_worker, initargs=(cfg, dict(_GROUPS))
    ) as pool:
        return list(progress(pool.imap_unordered(run_job, jobs), "ftltp runs", total=len(jobs)))


# ---------------------------------------------------------------------------------------
# Tables and plots
# ---------------------------------------------------------------------------------------


def collect(results: Sequence[tuple[Job, dict[str, Any], float]]) -> dict[tuple, list[float]]:
    """``{(study, method, pairing, group, target): [accuracy per run]}``; '*' pairings fill both."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for job, out, _ in results:
        for label, g, t in job.rows:
            labels = [f"{p[0]}+{p[1]}" for p in PAIRINGS if g in p] if label == "*" else [label]
            for lab in labels:
                cells[(job.study, job.method, lab, g, t)].append(out["acc"][g])
    return cells


def target_rows(
    groups: dict[str, GroupData], pairings: Sequence[tuple[str, str]]
) -> list[tuple[str, str, int]]:
    return [(f"{a}+{b}", g, t) for a, b in pairings for g in (a, b) for t in range(len(groups[g].domains))]


def main_table(cells: dict, groups: dict[str, GroupData], methods: Sequence[str]) -> str:
    """Per-target mean ± std (%) of every method."""
    rows = []
    for lab, g, t in target_rows(groups, PAIRINGS):
        row = [lab, f"{g}: {groups[g].domains[t]}"]
        for m in methods:
            vals = cells.get(("main", m, lab, g, t))
            row.append(fmt_pct(vals) if vals else "–")
        rows.append(row)
    return markdown_table(["pairing", "target (unseen)", *methods], rows)


def fmt_pct(vals: Sequence[float]) -> str:
    mu, sd = mean_std([100 * v for v in vals])
    return f"{mu:.1f} ± {sd:.1f}"


def gains(cells: dict, groups: dict[str, GroupData], ours: str, theirs: str) -> tuple[float, int, int] | None:
    """``ours``' mean accuracy gain over ``theirs`` across all targets (pp), and targets won / compared."""
    diffs = []
    for lab, g, t in target_rows(groups, PAIRINGS):
        a, b = cells.get(("main", ours, lab, g, t)), cells.get(("main", theirs, lab, g, t))
        if a and b:
            diffs.append(100 * (np.mean(a) - np.mean(b)))
    if not diffs:
        return None
    return float(np.mean(diffs)), int(sum(d > 0 for d in diffs)), len(diffs)


def gain_table(cells: dict, groups: dict[str, GroupData]) -> tuple[str, dict[str, float]]:
    """FTL-TP's (and the α = 0 ablation's) mean gain over each baseline, next to the paper's."""
    rows, measured = [], {}
    for m in METHODS[: METHODS.index(NO_L2R)]:
        row = [m, f"+{PAPER_GAIN[m]:.2f}"]
        for ours in ("FTL-TP", NO_L2R):
            got = gains(cells, groups, ours, m)
            row.append("–" if got is None else f"{got[0]:+.2f} ({got[1]}/{got[2]})")
            if got is not None and ours == "FTL-TP":
                measured[m] = got[0]
        rows.append(row)
    headers = ["gain over", "paper: FTL-TP", "ours: FTL-TP (targets won)", f"ours: {NO_L2R} (targets won)"]
    return markdown_table(headers, rows), measured


def variant_table(
    cells: dict, groups: dict[str, GroupData], studies: Sequence[str], names: Sequence[str]
) -> str:
    rows = []
    for lab, g, t in target_rows(groups, [("M", "S")]):
        row = [f"{g}: {groups[g].domains[t]}"]
        base = cells.get(("main", "FTL-TP", lab, g, t))
        for s in studies:
            vals = cells.get((s, "FTL-TP", lab, g, t))
            if not vals:
                row.append("–")
                continue
            mu, sd = mean_std([100 * v for v in vals])
            delta = "" if s == "main" or not base else f" ({100 * (np.mean(vals) - np.mean(base)):+.1f})"
            row.append(f"{mu:.1f} ± {sd:.1f}{delta}")
        rows.append(row)
    return markdown_table(["target (M+S)", *names], rows)


def plot_bars(path: Path, cells: dict, groups: dict[str, GroupData], methods: Sequence[str]) -> Path | None:
    """Figures 4-5 in one: target accuracy per method, one panel per pairing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
    width = 0.8 / len(methods)
    for ax, pairing in zip(axes, PAIRINGS, strict=True):
        rows = target_rows(groups, [pairing])
        for k, m in enumerate(methods):
            means = [100 * np.mean(cells.get(("main", m, lab, g, t), [np.nan])) for lab, g, t in rows]
            stds = [100 * np.std(cells.get(("main", m, lab, g, t), [np.nan])) for lab, g, t in rows]
            ax.bar(np.arange(len(rows)) + k * width, means, width, yerr=stds, label=m, capsize=2)
        ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2)
        ax.set_xticklabels([f"{g}:{groups[g].domains[t]}" for _, g, t in rows], rotation=30, fontsize=8)
        ax.set_title(f"{'+'.join(pairing)}: accuracy on the unseen target")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    axes[1].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curve_means(
    results: Sequence[tuple[Job, dict[str, Any], float]], groups: Sequence[str]
) -> dict[str, np.ndarray]:
    """Mean target-accuracy curve (%) of each federated method over ``groups``' targets (main study)."""
    acc: dict[str, list] = defaultdict(list)
    for job, out, _ in results:
        for g in groups:
            if job.study == "main" and g in out.get("curves", {}):
                label = job.method if job.kind != "ftltp" else f"{job.method} ({'+'.join(job.args[0])})"
                acc[label].append(out["curves"][g])
    return {m: 100 * np.mean(np.array(v), axis=0) for m, v in acc.items() if v and len(v[0])}


def plot_target_curves(path: Path, results, cfg: Config) -> Path | None:
    """Accuracy on the unseen target against the round, one panel per group."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    for ax, group in zip(axes, ("M", "S", "T"), strict=True):
        for label, ys in sorted(curve_means(results, (group,)).items()):
            xs = cfg.eval_every * np.arange(1, len(ys) + 1)
            ax.plot(xs, ys, label=label, ls="-" if label.startswith("FTL-TP") else "--")
        ax.set_title(f"group {group}: mean over its targets and the repeats")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("accuracy on the unseen target (%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def mechanism_table(results, groups: dict[str, GroupData]) -> str:
    """FTL-TP with and without L2R: last-round training loss, mean‖z‖² and target accuracy, per group."""
    agg: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for job, out, _ in results:
        if job.study != "main" or "train" not in out:
            continue
        for g, stats in out["train"].items():
            key = (job.method, g)
            for k in ("train_loss", "z_sq", "z_sq_source", "z_sq_target"):
                agg[key][k].append(stats[k])
            agg[key]["acc"].append(out["acc"][g])
    rows = [
        [
            m,
            g,
            f"{np.mean(v['train_loss']):.4f}",
            f"{np.mean(v['z_sq']):.1f}",
            f"{np.mean(v['z_sq_source']):.1f}",
            f"{np.mean(v['z_sq_target']):.1f}",
            f"{np.mean(v['z_sq_target']) / np.mean(v['z_sq_source']):.1f}",
            f"{100 * np.mean(v['acc']):.1f}",
        ]
        for (m, g), v in sorted(agg.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    ]
    headers = [
        "method",
        "group",
        "train CE, last round",
        "mean ‖z‖², last round's minibatches",
        "final base: source",
        "final base: unseen target",
        "target / source",
        "target acc (%)",
    ]
    return markdown_table(headers, rows)


def report(cfg: Config, groups: dict[str, GroupData], results, seconds: float) -> str:
    """The markdown body: setup line, main table, gains, unbalanced and fraction tables."""
    cells = collect(results)
    parts = [
        f"Simulated welds (data seed {cfg.data_seed}, time_scale {cfg.time_scale}): M {cfg.n_m}/domain, "
        f"S/T {cfg.n_s}/domain; {cfg.clients_per_domain} clients per source domain; repeats (seeds) "
        f"{list(cfg.seeds)}; {cfg.rounds} rounds (federated) or epochs (IL, CL, CTL; CTL: as many again "
        f"to fine-tune); B {cfg.batch}, lr {cfg.lr}, E 1; FTL-TP α_L2R {cfg.alpha_ftltp:g}, μ {cfg.mu_ftltp:g}; "
        f"features standardised: {cfg.standardize}.  Accuracy (%) on the never-seen target domain, "
        f"mean ± std over runs.  {len(results)} runs in {seconds:.0f} s wall ({cfg.workers} workers)."
    ]
    cpu: dict[str, float] = defaultdict(float)
    for job, _, sec in results:
        cpu[job.method if job.study == "main" else f"FTL-TP {job.study}"] += sec
    parts.append("Worker seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items()) + ".")
    methods = [m for m in METHODS if m in cfg.methods]
    if "main" in cfg.studies:
        parts += ["## Accuracy on the unseen target (Figures 4-5)", main_table(cells, groups, methods)]
        table, _ = gain_table(cells, groups)
        parts += [
            "## Mean accuracy gain over each method across the 14 target rows (percentage points)",
            table,
            "## What the L2R term does here: FTL-TP with and without it (main study, all runs)",
            mechanism_table(results, groups),
            "Final base: mean‖z‖² of the last global base (fc0 + ReLU) over the group's pooled source rows "
            "and over its unseen target rows, averaged over runs.  L2R silences the base on the source "
            "rows' subspace only; the target's activity stays large.  (Under `group` standardisation the T "
            "target DMGD lies up to ~1.8e3 source standard deviations out on a few features, which "
            "dominates the T row's target mean for every method.)",
        ]
    if "unbalanced" in cfg.studies:
        parts += [
            f"## Unbalanced clients (§5.4, M+S): M {list(cfg.unbalanced_m)} per source domain, "
            f"first S source domain {list(cfg.unbalanced_s)}; (change vs balanced)",
            variant_table(cells, groups, ["main", "unbalanced"], ["balanced", "unbalanced"]),
            "Paper: M drops by less than 2.05 points; S drops negligibly for Clean and Polished, 7.17 for Contam.",
        ]
    if "fraction" in cfg.studies:
        parts += [
            "## Client fraction per group (§5.5, M+S): FTL-TP (change vs C = 1)",
            variant_table(cells, groups, ["C=1/3", "C=2/3", "main"], ["C = 1/3", "C = 2/3", "C = 1"]),
            "Paper: accuracy in M grows with C; C = 1/3 is comparable to the FL baselines at C = 1 and to CL.",
        ]
    return "\n\n".join(parts)


def build_parser():
    parser = study_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(seeds=None)  # None: the mode's own (5 repeats; 2 with --quick)
    parser.add_argument("--study", nargs="+", choices=STUDIES, default=list(STUDIES), help="which studies")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods (main)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds / epochs (default 30; paper 150)")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the simulated welds")
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    parser.add_argument(
        "--standardize",
        choices=STANDARDIZE,
        default="fleet",
        help="feature standardisation (default fleet: the task's pooled n, Σx, Σx², as devices do; see the docstring)",
    )
    parser.add_argument(
        "--alpha-ftltp",
        type=float,
        default=None,
        help="FTL-TP's α_L2R (default §5.1's 0.001); other values are a sensitivity sweep, own files",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = quick_config() if args.quick else Config()
    cfg = replace(
        cfg,
        seeds=tuple(args.seeds) if args.seeds is not None else cfg.seeds,
        studies=tuple(args.study),
        methods=tuple(args.methods),
        rounds=args.rounds or cfg.rounds,
        data_seed=args.data_seed,
        workers=args.workers,
        standardize=args.standardize,
        alpha_ftltp=cfg.alpha_ftltp if args.alpha_ftltp is None else args.alpha_ftltp,
    )
    started = time.perf_counter()
    groups = load_groups(cfg)
    results = run_study(cfg, groups)
    seconds = time.perf_counter() - started
    body = report(cfg, groups, results, seconds)
    print(body)
    if args.no_write:
        return 0
    name = "ftltp_welding_quick" if args.quick else "ftltp_welding"
    if args.rounds and args.rounds != Config.rounds:  # e.g. the paper's 150: its own files
        name += f"_r{args.rounds}"
    if cfg.standardize != Config.standardize:
        name += f"_std-{cfg.standardize}"
    if cfg.alpha_ftltp != Config.alpha_ftltp:  # a sensitivity sweep, never the default table
        name += f"_alpha{cfg.alpha_ftltp:g}"
    cells = collect(results)
    plots = []
    if "main" in cfg.studies:
        plots.append(
            plot_bars(RESULTS / f"{name}.png", cells, groups, [m for m in METHODS if m in cfg.methods])
        )
        plots.append(plot_target_curves(RESULTS / f"{name}_curves.png", results, cfg))
    path = write_result(name, body, command="python -m benchmarks.ftltp_welding " + " ".join(sys.argv[1:]))
    print(f"\nwrote {path} and {', '.join(str(p) for p in plots if p)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Robust aggregation under attack: 20 simulated printers, 20% of them Byzantine.

The fleet of ``cloud-aggregator demo`` (simulated printers, the sigmoid GLM of
PFL-DA Table 4, ``weighting = "uniform"``), in process through
``cloud_aggregator.rounds.simulation``.  Four printers (20%, drawn per seed) train like
everyone else but upload a poisoned version of their change ``Δ = θ − g``:

``scale-10``  ``g − 10·Δ``;  ``scale100``  ``g + 100·Δ``;  ``signflip``  ``g − Δ``;
``random``  ``g + ε``, ``ε ~ N(0, 1)`` per coordinate (parameters are O(1)).

Every reducer of ``cloud_aggregator.aggregation.reducers`` runs every attack and the clean fleet;
the figure is the final mean personalized test loss over the 16 honest printers
(lower is better; PFL-DA Table 5's units, ``50 · MSE(s/50)``), mean ± sd over seeds.
Seeds vary the initial model, which printers attack and the random attack's noise;
the printers' data is the simulated fleet of seed 0 (generated once, ~60 s, and
cached under ``$XDG_CACHE_HOME/ioft``).

Run ``python -m benchmarks.robust_aggregation [--quick] [--seeds 0 1 2] [--algorithm fedavg]``.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.common import (
    RESULTS,
    fmt_mean_std,
    markdown_table,
    mean_std,
    plot_curves,
    progress,
    study_parser,
    write_result,
)
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet
from cloud_aggregator.rounds.types import CollectRequest, RoundRecord
from trainer_lite.client import derive_rng
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

#: PFL-DA Table 5's loss units, as ``cloud_aggregator.local.demo`` prints them.
LOSS_SCALE = 50.0
HPARAMS = {"lr": 0.1, "weight_decay": 3e-4, "local_steps": 10}
ATTACKS = ("none", "scale-10", "scale100", "signflip", "random")
#: (label, reducer, reducer_args); f = 4 is the number of attackers among 20.  The first
#: row (the plain mean) is relabelled per algorithm: see :func:`reducer_rows`.
REDUCERS: tuple[tuple[str, str, dict], ...] = (
    ("fedavg (mean)", "mean", {}),
    ("clip (median norm)", "clip", {}),
    ("median", "median", {}),
    ("trimmed mean β=0.2", "trimmed_mean", {"beta": 0.2}),
    ("krum f=4", "krum", {"f": 4}),
    ("multi-krum f=4 m=12", "krum", {"f": 4, "m": 12}),
)


@dataclass(frozen=True)
class Run:
    reducer: str
    attack: str
    seed: int
    final_loss: float  # honest printers' mean test loss, LOSS_SCALE units
    curve: tuple[float, ...]  # the same after every round


def printers(n: int, *, cache: bool = True) -> dict[str, ClientData]:
    """``n`` simulated printers (``edge.simulated``), cached on disk: generating one takes ~3 s."""
    from edge.config import DataConfig
    from edge.simulated import simulated_printer_dataset

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ioft"
    path = root / f"robust_printers_{n}.pkl"
    if cache and path.exists():
        with path.open("rb") as fh:
            return pickle.load(fh)  # our own cache file, written below
    out = {}
    for i in progress(range(1, n + 1), "simulating printers"):
        train, test, _ = simulated_printer_dataset(f"printer{i}", DataConfig(source="simulate-printer"))
        out[f"printer{i}"] = ClientData(train, test)
    if cache:
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as fh:
            pickle.dump(out, fh)
        tmp.replace(path)
    return out


def poison(attack: str, g: Params, params: Params, rng: np.random.Generator) -> Params:
    """The attacker's upload from its honest one (see the module docstring)."""
    out = {}
    for n, v in params.items():
        base = g.get(n, np.zeros_like(v))
        delta = v - base
        if attack == "scale-10":
            p = base - 10.0 * delta
        elif attack == "scale100":
            p = base + 100.0 * delta
        elif attack == "signflip":
            p = base - delta
        elif attack == "random":
            p = base + rng.standard_normal(v.shape)
        else:
            raise ValueError(f"unknown attack {attack!r}; have {ATTACKS}")
        out[n] = np.asarray(p, dtype=v.dtype)
    return out


class AttackedFleet(SimulatedFleet):
    """A simulated fleet whose ``attackers`` upload :func:`poison` of what they trained."""

    def __init__(self, spec: TaskSpec, clients, attackers: Sequence[str], attack: str, seed: int) -> None:
        super().__init__(spec, clients)
        self.attackers = frozenset(attackers)
        self.attack = attack
        self.rng = derive_rng(seed, "attack-noise")

    def collect(self, request: CollectRequest):
        if self.attack == "none":
            return super().collect(request)
        # Whole uploads back (no streaming fold in admission), so the attack replaces what the
        # strategy combines; the round engine folds what is returned (RoundEngine._folded).
        replies = super().collect(replace(request, fold=None))
        out = []
        for r in replies:
            if isinstance(r, Update) and r.device in self.attackers:
                sent = request.downlinks.get(r.device, request.global_params)
                r = Update(r.device, poison(self.attack, sent, r.params, self.rng), r.n_samples, r.metrics)
            out.append(r)
        return out


def honest_loss(fleet: SimulatedFleet, g: Params, honest: Sequence[str]) -> float:
    per = fleet.evaluate(g)
    vals = [per[d]["loss"] for d in honest if d in per]
    loss = float(np.mean(vals)) * LOSS_SCALE
    return loss if np.isfinite(loss) else float("inf")


#: How the results name each algorithm.
ALGORITHM_NAMES = {"fedavg": "FedAvg", "pflda": "PFL-DA"}


def hparams_for(algorithm: str) -> dict:
    """The client hyperparameters of every run of ``algorithm`` (PFL-DA adds its λ)."""
    return dict(HPARAMS, **({"lam": 0.9} if algorithm == "pflda" else {}))


def reducer_rows(algorithm: str) -> tuple[tuple[str, str, dict], ...]:
    """``REDUCERS`` with the plain mean's row named after ``algorithm`` ("pflda (mean)")."""
    (_, mean_name, mean_args), *rest = REDUCERS
    return ((f"{algorithm} (mean)", mean_name, mean_args), *rest)


def run_one(
    clients: dict[str, ClientData],
    algorithm: str,
    reducer: tuple[str, dict],
    attack: str,
    seed: int,
    rounds: int,
    n_attackers: int,
) -> Run:
    name, args = reducer
    hparams = hparams_for(algorithm)
    spec = TaskSpec(
        "robust",
        algorithm,
        "sigmoid_glm",
        hparams=hparams,
        server={"weighting": "uniform", "reducer": name, "reducer_args": args},
        rounds=rounds,
        seed=seed,
    )
    devices = sorted(clients)
    rng = derive_rng(seed, "attackers")
    attackers = sorted(rng.choice(devices, size=n_attackers, replace=False).tolist())
    honest = [d for d in devices if d not in attackers]
    fleet = AttackedFleet(spec, clients, attackers, attack, seed)
    curve: list[float] = []
    engine: RoundEngine

    def record(rec: RoundRecord) -> None:
        curve.append(honest_loss(fleet, engine.global_params, honest))

    engine = RoundEngine(spec, fleet, on_record=record)
    with np.errstate(all="ignore"):  # a poisoned mean overflows: that is the finding, not an error
        final = engine.run()
        loss = honest_loss(fleet, final, honest)
    return Run(name + str(sorted(args.items())), attack, seed, loss, tuple(curve))


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--algorithm", default="fedavg", choices=("fedavg", "pflda"))
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 20, quick 8)")
    parser.add_argument("--printers", type=int, default=20)
    args = parser.parse_args(argv)
    rounds = args.rounds or (8 if args.quick else 20)
    seeds = args.seeds[:1] if args.quick and len(args.seeds) > 1 else args.seeds
    n_attackers = max(1, round(0.2 * args.printers))
    t0 = time.time()
    clients = printers(args.printers)
    t_data = time.time() - t0
    reducers = reducer_rows(args.algorithm)
    attacks = ATTACKS
    jobs = [(r, a, s) for r in reducers for a in attacks for s in seeds]
    results: dict[tuple[str, str], list[Run]] = {}
    t1 = time.time()
    for (label, name, rargs), attack, seed in progress(jobs, "runs"):
        run = run_one(clients, args.algorithm, (name, rargs), attack, seed, rounds, n_attackers)
        results.setdefault((label, attack), []).append(run)
    t_runs = time.time() - t1

    clean_ref = mean_std([r.final_loss for r in results[(reducers[0][0], "none")]])[0]

    def cell(label: str, attack: str) -> str:
        vals = [r.final_loss for r in results[(label, attack)]]
        if not all(np.isfinite(vals)):
            return "diverged (inf/NaN)"
        m, _ = mean_std(vals)
        if m > 1e3:
            return f"{m:.2e}"
        return fmt_mean_std(vals, 3) + f" ({m / clean_ref:.2f}×)"

    headers = ["reducer", *[("clean" if a == "none" else a) for a in attacks]]
    rows = [[label, *[cell(label, a) for a in attacks]] for label, _, _ in reducers]
    table = markdown_table(headers, rows)
    print(table)
    algo = ALGORITHM_NAMES[args.algorithm]
    clean_label = f"{algo}'s clean run" + (
        "" if args.algorithm == "fedavg" else " with the plain mean reducer"
    )
    body = (
        f"{args.printers} simulated printers, {n_attackers} attackers (20%), {args.algorithm} "
        f"(sigmoid GLM, {hparams_for(args.algorithm)}, weighting uniform), {rounds} rounds, seeds {seeds}.\n\n"
        f"Final mean personalized test loss of the honest printers (PFL-DA Table 5 units, "
        f"50·MSE(s/50)), mean ± sd over seeds; in brackets the ratio to {clean_label} "
        f"({clean_ref:.3f}). Attacks on the upload's change Δ = θ − g: scale-10 = g − 10Δ, "
        f"scale100 = g + 100Δ, signflip = g − Δ, random = g + N(0, 1).\n\n{table}\n\n"
        f"Wall time: data {t_data:.0f} s (cached after the first run), "
        f"{len(jobs)} runs {t_runs:.0f} s.\n"
    )
    if not args.no_write:
        name = "robust_aggregation" + ("" if args.algorithm == "fedavg" else f"_{args.algorithm}")
        name += "_quick" if args.quick else ""
        curves = {
            f"{reducers[0][0]} / clean": np.mean([r.curve for r in results[(reducers[0][0], "none")]], axis=0)
        }
        for attack in ("scale100", "signflip"):
            for label, _, _ in reducers:
                runs = results[(label, attack)]
                c = np.mean([r.curve for r in runs], axis=0)
                if np.all(np.isfinite(c)) and c.max() < 1e3:
                    curves[f"{label} / {attack}"] = c
        png = plot_curves(
            RESULTS / f"{name}.png",
            curves,
            title=f"{args.algorithm}, {n_attackers}/{args.printers} attackers: honest test loss",
            logy=True,
        )
        if png is not None:
            body += f"\n![curves]({png.name}) (curves that diverge past 10³ are left out)\n"
        # The module's real command line (the result's name carries the algorithm, the module does not).
        command = " ".join(
            ["python -m benchmarks.robust_aggregation", *(sys.argv[1:] if argv is None else argv)]
        )
        path = write_result(name, body, command=command)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

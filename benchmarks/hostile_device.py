"""Issue 32 §1-§2: one hostile device against a weld fleet's pooled statistics and weighted mean.

Four simulated welders of FTL-TP's group M (``edge.simulated.simulated_welder_dataset``: the
real intake path, 48 welds each, 36 to train), the 624-16-4 MLP of the README's weld task
(FedAvg, ``samples`` weighting), in process through ``cloud_aggregator.rounds.simulation`` (the
round engine and admission ``serve`` runs).  The figure is the mean test accuracy of the four
honest welders' models after ``--rounds`` rounds, mean ± sd over seeds (the initial model).

§1 (``scaling = "fleet"``): a fifth identity sends ``n = 10, Σx = 0, Σx² = 1e30`` on every
feature.  ``before``: the plain sum of every device's sums (the pool before the fix,
``Standardizer.from_sums``); ``after``: ``sensors.features.scaling.pool_feature_sums``.

§2: a fifth welder (a copy of welder 1's rows) reports a million training rows and answers each
round with ``n_samples = 1,000,000`` and the global plus N(0, 1) noise per parameter.
``before``: ``server.max_weight_ratio = false``; ``after``: the default cap (3 × the median);
``after + median``: the cap beside the coordinate-wise median reducer.

Run ``python -m benchmarks.hostile_device [--quick] [--seeds 0 1 2] [--rounds 30]``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import fmt_mean_std, markdown_table, study_parser, write_result
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet
from edge.config import DataConfig
from edge.simulated import simulated_welder_dataset
from ioft_protocol.round_messages import UpdateMessage
from sensors.features.scaling import Standardizer, feature_sums, pool_feature_sums
from trainer_lite.client import derive_rng
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

WELDERS = ("w1", "w2", "w3", "w4")
LIAR = "w5"
CLAIM = 1_000_000
LIES = (10, np.zeros(624), np.full(624, 1e30))  # issue 32 §1's statistics


def welders() -> dict[str, ClientData]:
    """The four honest welders' splits (simulated once per call: ~10 s)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for d in WELDERS:
            train, test, _ = simulated_welder_dataset(Path(tmp) / d, d, DataConfig("simulate-welder", seed=0))
            out[d] = ClientData(train, test)
    return out


def spec(seed: int, rounds: int, **server: object) -> TaskSpec:
    return TaskSpec(
        "tool",
        "fedavg",
        "mlp",
        model_args={"sizes": [624, 16, 4], "init": "kaiming"},
        hparams={"lr": 0.01, "loss": "cross_entropy", "local_steps": 5, "batch_size": 8},
        server={"weighting": "samples", **server},
        rounds=rounds,
        seed=seed,
    )


def scaled(clients: dict[str, ClientData], scaler: Standardizer) -> dict[str, ClientData]:
    def one(ds: Dataset) -> Dataset:
        return dataclasses.replace(ds, x=scaler.transform(ds.x))

    return {d: ClientData(one(c.train), one(c.test)) for d, c in clients.items()}


def accuracy(fleet: SimulatedFleet, task: TaskSpec) -> float:
    g = RoundEngine(task, fleet).run()
    per = fleet.evaluate(g)
    return float(np.mean([per[d]["accuracy"] for d in WELDERS]))


def stats_run(clients: dict[str, ClientData], case: str, seed: int, rounds: int) -> float:
    """§1: the fleet trained through the transform ``case`` pools."""
    sums = {d: feature_sums(c.train.x) for d, c in clients.items()}
    if case == "honest":
        scaler = pool_feature_sums(sums, 3)
    elif case == "before":
        scaler = Standardizer.from_sums([*(sums[d] for d in sorted(sums)), LIES])
    else:
        scaler = pool_feature_sums(sums | {LIAR: LIES}, 3)
    task = spec(seed, rounds)
    return accuracy(SimulatedFleet(task, scaled(clients, scaler)), task)


def weight_run(clients: dict[str, ClientData], case: str, seed: int, rounds: int) -> float:
    """§2: a fifth welder claims a million rows and uploads noise."""
    scaler = pool_feature_sums({d: feature_sums(c.train.x) for d, c in clients.items()}, 3)
    data = scaled(clients, scaler)
    server: dict[str, object] = {
        "honest": {},
        "before": {"max_weight_ratio": False},
        "after": {},
        "after + median": {"reducer": "median"},
    }[case]
    task = spec(seed, rounds, **server)
    if case == "honest":
        return accuracy(SimulatedFleet(task, data), task)
    rng = derive_rng(seed, "liar-noise")

    def lie(request, sent):
        out = []
        for device, msg in sent:
            if device == LIAR and isinstance(msg, UpdateMessage):
                noise = {
                    k: (v + rng.normal(size=v.shape)).astype(v.dtype)
                    for k, v in request.global_params.items()
                }
                msg = dataclasses.replace(msg, n_samples=CLAIM, params=noise)
            out.append((device, msg))
        return out

    fleet = SimulatedFleet(task, data | {LIAR: data["w1"]}, uplinks=lie)
    rows = fleet.admission.reported_rows
    fleet.admission.reported_rows = lambda d: CLAIM if d == LIAR else rows(d)  # its status's claim
    return accuracy(fleet, task)


def main(argv: Sequence[str] | None = None) -> int:
    parser = study_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    logging.getLogger("cloud_aggregator.rounds.engine").setLevel(logging.ERROR)  # a cut line per round
    rounds, seeds = (5, args.seeds[:1]) if args.quick else (args.rounds, args.seeds)
    started = time.time()
    clients = welders()
    rows = []
    for item, run, cases in (
        ("§1 pooled statistics", stats_run, ("honest", "before", "after")),
        ("§2 weighted mean", weight_run, ("honest", "before", "after", "after + median")),
    ):
        for case in cases:
            accs = [run(clients, case, s, rounds) for s in seeds]
            rows.append((item, "no liar" if case == "honest" else f"liar, {case}", fmt_mean_std(accs)))
            print(*rows[-1], sep=" | ", flush=True)
    table = markdown_table(["issue 32", "fleet", "honest welders' test accuracy"], rows)
    body = f"{rounds} rounds, seeds {seeds}, {time.time() - started:.0f} s.\n\n{table}\n"
    print(body)
    if not args.no_write and not args.quick:
        command = "python -m benchmarks.hostile_device " + " ".join(sys.argv[1:] if argv is None else argv)
        write_result("hostile_device", __doc__ + "\n" + body, command=command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())

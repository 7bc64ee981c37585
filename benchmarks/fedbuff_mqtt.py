"""FedBuff vs synchronous rounds over real MQTT: ``python -m benchmarks.fedbuff_vs_sync --mqtt [...]``.

The same task and conditions as the simulated comparison (``benchmarks.fedbuff_vs_sync``), but
every message crosses a real mosquitto and every device is a real MQTT client running the
daemon's code: ``cloud-aggregator serve`` (``mode = "sync"``, or ``"buffered"``: FedBuff,
``cloud_aggregator.serve.buffered_mqtt``) and two ``edge-trainer --swarm`` processes, one of the fast
devices and one of the slow.  Each device's rows are its own simulated printer's (the in-process
benchmark's ``printer_clients``), written into its state folder before it starts.

Speeds and churn are the devices' ``[simulate]`` pace (``edge.buffered``): an answer leaves
``T0 × speed × jitter`` after the announcement it trains from (speed 10 for 10% of the devices,
1 for the rest; log-normal jitter σ = 0.1), and a device leaves within any ``10 × T0`` with
probability 5% (retained status offline, its job lost) and comes back after an exponential time
of mean ``10 × T0``.  Time is **wall time** on this machine, from the task's start (its first
round or buffer application) -- device start-up excluded for both.

The fleet loss after each round or buffer application is the mean over the devices of the test
loss each reported with its latest upload (its personalized model after that update), PFL-DA
Table 5 units (50·MSE(s/50)): what the store, ``fleet status`` and the console see.  The target
is the synchronous run's fleet loss after ``--rounds`` rounds, per seed; FedBuff runs until it
reaches it or ``--cap`` times the synchronous time.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import markdown_table, progress, write_result
from benchmarks.fedbuff_sim import EXTRA, PAPER_SPEEDUP, Conditions, Curve, fedbuff_label, printer_clients
from cloud_aggregator.local.broker import interrupt_on_sigterm
from cloud_aggregator.local.demo import HPARAMS, LOSS_SCALE
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml
from cloud_aggregator.rounds.types import RoundRecord
from edge.dataset import save_dataset

TASK = "speed"


def device_toml(pace: Conditions, seed: int, slow: bool) -> str:
    """A swarm's ``[simulate]`` table: ``pace`` (``t0`` in wall seconds) for its fast or slow devices."""
    update = pace.t0 * (pace.slow_factor if slow else 1.0)
    return (
        f"[simulate]\nupdate_s = {update}\njitter = {pace.jitter}\nleave_per_s = {pace.leave_rate}\n"
        f"away_s = {pace.away_mean * pace.t0}\nseed = {seed}\n"
    )


def prepare(work: Path, seed: int, pace: Conditions, algorithm: str) -> dict[str, int]:
    """Each device's dataset and the two swarms' configs; ``{swarm prefix: devices}``."""
    clients = printer_clients(pace.devices, seed)
    names = sorted(clients)
    slow = pace.draw_slow(names, seed)
    counts = {"fast": 0, "slow": 0}
    for name in names:
        prefix = "slow" if name in slow else "fast"
        data = clients[name]
        folder = work / prefix / f"{prefix}{counts[prefix]:05d}"
        save_dataset(folder, data.train, data.test, {"source": f"fedbuff-mqtt:{name}"})
        counts[prefix] += 1
    for prefix in counts:
        (work / f"{prefix}.toml").write_text(device_toml(pace, seed, prefix == "slow"))
    return {p: n for p, n in counts.items() if n}


def task_table(algorithm: str, rounds: int, seed: int, buffered: tuple[int, float] | None) -> dict:
    task: dict[str, object] = {
        "name": TASK,
        "algorithm": algorithm,
        "model": "sigmoid_glm",
        "rounds": rounds,
        "seed": seed,
        "hparams": HPARAMS | EXTRA[algorithm],
        "server": {"weighting": "uniform"},
    }
    if buffered is not None:
        k, lr = buffered
        task |= {"mode": "buffered", "buffered": {"k": k, "server_lr": lr, "max_staleness": 1000}}
    return task


def curve_of(records: list[RoundRecord]) -> Curve:
    """Fleet loss after each record: the mean of each device's latest reported test loss."""
    curve, latest = Curve(), {}
    if not records:
        return curve
    start = records[0].started
    for rec in records:
        for device, metrics in rec.metrics.items():
            if "test_loss" in metrics:
                latest[device] = LOSS_SCALE * metrics["test_loss"]
        curve.updates += len(rec.extra.get("arrivals", rec.participants))
        curve.times.append(rec.finished - start)
        curve.losses.append(float(np.mean(list(latest.values()))) if latest else math.inf)
        curve.work.append(curve.updates)
    return curve


def run_one(
    work: Path,
    seed: int,
    pace: Conditions,
    *,
    algorithm: str,
    rounds: int,
    buffered: tuple[int, float] | None,
    until: Callable[[Curve], bool] | None = None,
) -> tuple[Curve, dict]:
    """One run on a fresh broker and fleet, until the task is done or ``until(curve)``; the curve
    and the last record's ledger (buffered)."""
    swarms = prepare(work, seed, pace, algorithm)
    task = task_table(algorithm, rounds if buffered is None else 1_000_000, seed, buffered)
    with LocalFleet.start(work, prefer="mosquitto") as fleet:
        for prefix, n in swarms.items():
            fleet.start_device(
                prefix,
                *("--swarm", str(n), "--config", str(work / f"{prefix}.toml"), "--log-level", "WARNING"),
                simulate=None,
            )
        toml = aggregator_toml(
            fleet.broker_url,
            work / "aggregator",
            [task],
            deadline_s=120.0,
            min_participants=max(1, int(0.75 * pace.devices)),
            max_extensions=2,
            startup_wait_s=120.0,
        )
        fleet.start_aggregator(toml, log_level="WARNING")
        while fleet.aggregator.poll() is None:
            time.sleep(0.5)
            if until is not None and until(curve_of(fleet.rounds(TASK))):
                break
        if fleet.aggregator.poll() not in (None, 0):
            raise RuntimeError(f"aggregator failed:\n{fleet.log('aggregator')[-3000:]}")
        records = fleet.rounds(TASK)
    return curve_of(records), (records[-1].extra.get("ledger", {}) if records else {})


@dataclass
class SeedRun:
    target: float
    curves: dict[str, Curve]
    ledgers: dict[str, dict]


def run_seed(
    root: Path,
    seed: int,
    pace: Conditions,
    settings: list[tuple[int, float]],
    *,
    algorithm: str,
    rounds: int,
    cap: float,
) -> SeedRun:
    sync, _ = run_one(root / f"s{seed}-sync", seed, pace, algorithm=algorithm, rounds=rounds, buffered=None)
    target = sync.losses[-1]
    limit, horizon = cap * sync.time_to(target), sync.times[-1]

    def until(curve: Curve) -> bool:
        """On to the synchronous run's end once the target is reached (for "stays below"), or to the cap."""
        t = curve.times[-1] if curve.times else 0.0
        return (curve.time_to(target) < math.inf and t >= horizon) or t > limit

    curves, ledgers = {"sync": sync}, {}
    for k, lr in settings:
        label = fedbuff_label(k, lr)
        curves[label], ledgers[label] = run_one(
            root / f"s{seed}-k{k}",
            seed,
            pace,
            algorithm=algorithm,
            rounds=rounds,
            buffered=(k, lr),
            until=until,
        )
    return SeedRun(target, curves, ledgers)


def report(results: dict[int, SeedRun], labels: list[str], cap: float) -> str:
    """Medians over seeds, and the per-seed rows."""
    rows, per_seed = [], []
    for label in labels:
        times = [r.curves[label].time_to(r.target) for r in results.values()]
        ups = [
            r.curves["sync"].time_to(r.target) / r.curves[label].time_to(r.target) for r in results.values()
        ]
        reached = sum(math.isfinite(t) for t in times)
        work = [r.curves[label].work_to(r.target) for r in results.values()]
        rows.append(
            [
                label,
                f"{statistics.median(times):.1f}"
                if reached == len(times)
                else f"> {cap:g}× sync ({reached}/{len(times)} seeds)",
                "1.00×" if label == "sync" else f"{statistics.median(ups):.2f}×",
                "-" if label == "sync" else f"{PAPER_SPEEDUP}×",
                "-" if None in work else f"{statistics.median(work):.0f}",
            ]
        )
        for seed, r in results.items():
            c, led = r.curves[label], r.ledgers.get(label, {})
            per_seed.append(
                [
                    seed,
                    label,
                    f"{r.target:.4f}",
                    f"{c.time_to(r.target):.1f}",
                    f"{c.held_from(r.target):.1f}",
                    next((i for i, v in enumerate(c.losses, 1) if v <= r.target), "-"),
                    c.work_to(r.target) or "-",
                    f"{c.losses[-1]:.4f}" if c.losses else "-",
                    led.get("refused", "-"),
                    led.get("abandoned", "-"),
                ]
            )
    head = ["method", "wall s to target (median)", "speed-up vs sync (median)", "paper", "uploads to target"]
    seed_head = [
        "seed",
        "method",
        "target",
        "wall s",
        "stays below from (s)",
        "server steps",
        "uploads to target",
        "fleet loss at stop",
        "refused",
        "abandoned",
    ]
    return markdown_table(head, rows) + "\n\nPer seed:\n\n" + markdown_table(seed_head, per_seed)


def load_line() -> str:
    """The machine's 1-minute load average and core count (the benchmark shares the machine)."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


SUMMARY = """\
**Over real MQTT.** {algorithm} (the demo's sigmoid GLM and hyperparameters) on {devices} printers
(each its own simulated printer's rows) as two `edge-trainer --swarm` processes, a mosquitto and
`cloud-aggregator serve`, all on this machine; 10% of the devices 10× slower, 5% churn (module
docstring of `benchmarks/fedbuff_mqtt.py`).  T0 = {t0:g} s of simulated compute per update (the
device's `[simulate] update_s`; the training itself, ~4 ms, runs on top).  Time is **wall time**
from the task's first round or buffer application.  Target: the synchronous run's fleet loss after
{rounds} rounds, per seed.  The machine has 2 cores shared with other work ({load_before} at the
start, {load_after} at the end), so the fleet is kept small and the seeds run one after another.
"""


def main(args: argparse.Namespace, lrs: list[float]) -> int:
    """``fedbuff_vs_sync --mqtt``: the runs, the table and ``benchmarks/results/fedbuff_mqtt.md``
    (``lrs``: η_g for each of ``args.k``)."""
    interrupt_on_sigterm()  # a SIGTERM unwinds through each fleet's `with`: its processes stop too
    settings = list(zip(args.k, lrs, strict=True))
    pace = Conditions(devices=args.devices, t0=args.t0)
    load_before = load_line()
    results: dict[int, SeedRun] = {}
    with tempfile.TemporaryDirectory(prefix="fedbuff-mqtt-") as tmp:
        for seed in progress(args.seeds, "seeds", total=len(args.seeds)):
            results[seed] = run_seed(
                Path(tmp), seed, pace, settings, algorithm=args.algorithm, rounds=args.rounds, cap=args.cap
            )
    labels = ["sync", *(fedbuff_label(k, lr) for k, lr in settings)]
    table = report(results, labels, args.cap)
    print(table)
    if not args.no_write:
        body = SUMMARY.format(
            algorithm=args.algorithm,
            devices=args.devices,
            t0=args.t0,
            rounds=args.rounds,
            load_before=load_before,
            load_after=load_line(),
        )
        write_result(
            "fedbuff_mqtt",
            body + "\n" + table,
            command="python -m benchmarks.fedbuff_vs_sync " + " ".join(sys.argv[1:]),
        )
    return 0

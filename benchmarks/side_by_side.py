"""Tasks over disjoint devices side by side against one after another.

The same fleet twice over, alternating: 2 simulated printers and 2 simulated welders, a
PFL-DA printer task and a FedAvg weld task of ``--rounds`` rounds each.  "side by side": the
printer task selects ``kind = "printer"`` (the weld task selects welders), so ``serve`` runs
them at once; "one after another": the printer task selects no kind, so the weld task waits
for it.  Figure: the span from the first round's start to the last round's end, per run.

    python -m benchmarks.side_by_side [--rounds 10] [--pairs 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml, pflda_task

PRINTERS = ["printer1", "printer2"]
WELDERS = ["welder1", "welder2"]


def weld_task(rounds: int) -> dict[str, object]:
    return {
        "name": "tool",
        "algorithm": "fedavg",
        "model": "mlp",
        "rounds": rounds,
        "model_args": {"sizes": [624, 16, 4], "init": "kaiming"},
        "hparams": {"lr": 0.001, "loss": "cross_entropy", "local_steps": 2, "batch_size": 8},
        "devices": {"kind": "welder"},
    }


def span(side_by_side: bool, rounds: int) -> float:
    """Seconds from the first round's start to the last round's end, both tasks together."""
    work = Path(tempfile.mkdtemp(prefix="ioft-side-by-side-"))
    with LocalFleet.start(work, prefer="mosquitto") as fleet:
        fleet.start_devices(PRINTERS, "--log-level", "WARNING")
        fleet.start_devices(WELDERS, "--log-level", "WARNING", simulate="welder")
        speed = pflda_task(rounds=rounds)
        if side_by_side:
            speed = {**speed, "devices": {"kind": "printer"}}
        toml = aggregator_toml(
            fleet.broker_url,
            work / "aggregator",
            [speed, weld_task(rounds)],
            expected=PRINTERS + WELDERS,
            deadline_s=60.0,
            startup_wait_s=120.0,
        )
        fleet.start_aggregator(toml)
        if fleet.wait_aggregator(600) != 0:
            raise RuntimeError(fleet.log("aggregator")[-2000:])
        records = fleet.rounds("speed") + fleet.rounds("tool")
        fleet.stop_all()
    return max(r.finished for r in records) - min(r.started for r in records)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="rounds of each task")
    p.add_argument("--pairs", type=int, default=2, help="runs of each mode, alternating")
    args = p.parse_args(argv)
    spans: dict[str, list[float]] = {"one after another": [], "side by side": []}
    for _ in range(args.pairs):
        for mode, together in (("one after another", False), ("side by side", True)):
            spans[mode].append(span(together, args.rounds))
            print(f"{mode}: {spans[mode][-1]:.2f} s", flush=True)
    for mode, values in spans.items():
        print(f"{mode}: median {statistics.median(values):.2f} s over {len(values)} runs")


if __name__ == "__main__":
    main()

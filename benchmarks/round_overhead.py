"""What a round costs: the real aggregator, mosquitto and N ``edge-trainer`` processes
running the zero-compute ``echo`` algorithm with P float32 shared parameters.

Per (N, P): median round wall time over the measured rounds (after a warm-up),
bytes through the broker per round against the raw payload, and peak RSS of one
device process and of the aggregator.  Bytes are read from the broker's
``/proc/<pid>/io`` (socket reads + writes; mosquitto runs without persistence or
logging to disk, so that is all network traffic): per round the broker moves
``(3N + 1)·4P`` payload bytes — N uploads in and out, one announcement in and N out
— of which ``2N·4P`` cross the device links.

Reference (from the issue, measured on this kind of machine): Flower 1.42's
deployment engine never took less than ~6.3 s per round (~45 s at N = 20),
~130–170 MB per SuperNode process, ~380–445 MB per device at peak, bytes ≈
1.01–1.04× the payload plus ~50 KB per device per round.
Targets: ≤ 0.5 s per round at N = 20, P = 150k; a device process ≤ 100 MB;
bytes ≤ 1.05× the payload.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, progress, remove_scratch, study_parser, write_result
from cloud_aggregator.local.broker import interrupt_on_sigterm, start_mosquitto
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml
from cloud_aggregator.store.sqlite import SqliteStore


def proc_io(pid: int) -> int:
    """Bytes read + written by a process (all file descriptors, sockets included)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def run_case(n: int, p: int, rounds: int, warmup: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"ioft-bench-{n}-{p}-"))
    # mosquitto only (its bytes are what is measured), and no broker log: its I/O is all network.
    fleet = LocalFleet.start(work, broker=start_mosquitto())
    try:
        names = [f"dev{i}" for i in range(n)]
        fleet.start_devices(names, "--log-level", "WARNING", simulate="printer")
        task = {
            "name": "bench",
            "algorithm": "echo",
            "model": "vector",
            "rounds": warmup + rounds,
            "model_args": {"size": p},
        }
        toml = aggregator_toml(
            fleet.broker_url,
            work / "aggregator",
            [task],
            expected=names,
            deadline_s=60,
            settings={"max_payload_bytes": 16777216},
        )
        agg = fleet.start_aggregator(toml, log_level="WARNING")
        broker = fleet.broker
        db = work / "aggregator" / "aggregator.sqlite"
        io_start = io_end = None
        agg_peak = 0.0
        monitor: SqliteStore | None = None
        # Polled every 5 ms: the byte window opens and closes at round boundaries, and a coarse
        # poll would let part of the next round's traffic into it (rounds take ~10-50 ms here).
        while agg.poll() is None:
            if monitor is None and db.exists():
                monitor = SqliteStore(db, readonly=True)
            done = monitor.round_count("bench") if monitor is not None else 0
            if io_start is None and done >= warmup:
                io_start = (proc_io(broker.proc.pid), done)
            if io_end is None and done >= warmup + rounds:
                io_end = (proc_io(broker.proc.pid), done)
            agg_peak = max(agg_peak, peak_rss_mb(agg.pid))
            time.sleep(0.005)
        if monitor is not None:
            monitor.close()
        if agg.returncode != 0:
            raise RuntimeError(f"aggregator failed: {fleet.log('aggregator')[-2000:]}")
        store = SqliteStore(db, readonly=True)
        recs = [r for r in store.rounds("bench") if warmup < r.round <= warmup + rounds]
        refused = store.rejection_counts("bench")
        store.close()
        thin = [r.round for r in recs if len(r.participants) != n]
        if thin or refused:  # a round that waited for its deadline measures the deadline, not the system
            raise RuntimeError(f"rounds {thin} lacked uploads; refused per device: {refused}")
        if io_start is None or io_end is None:
            raise RuntimeError("the measured window was never observed")
        broker_bytes = (io_end[0] - io_start[0]) / (io_end[1] - io_start[1])
        raw_broker = (3 * n + 1) * 4 * p
        return {
            "n": n,
            "p": p,
            "round_s": statistics.median(r.finished - r.started for r in recs),
            "round_s_max": max(r.finished - r.started for r in recs),
            "broker_bytes": broker_bytes,
            "raw_broker": raw_broker,
            "raw_devices": 2 * n * 4 * p,
            "device_rss": max(peak_rss_mb(d.pid) for d in fleet.devices.values()),
            "agg_rss": agg_peak,
        }
    finally:
        fleet.stop()
        remove_scratch(work)


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[5, 20])
    parser.add_argument("--params", type=int, nargs="+", default=[1_000, 150_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    interrupt_on_sigterm()  # each case's `finally` stops its broker and devices
    if args.quick:
        args.devices, args.params, args.rounds = [3], [1_000, 150_000], 3
    cases = [(n, p) for n in args.devices for p in args.params]
    rows, results = [], []
    for n, p in progress(cases, "cases"):
        r = run_case(n, p, args.rounds, args.warmup)
        results.append(r)
        rows.append(
            [
                r["n"],
                f"{r['p']:,}",
                f"{r['round_s'] * 1000:.0f} ms",
                f"{r['round_s_max'] * 1000:.0f} ms",
                f"{r['broker_bytes'] / 1e6:.3f} MB",
                f"{r['broker_bytes'] / r['raw_broker']:.3f}×",
                f"{(r['broker_bytes'] - r['raw_broker']) / (3 * r['n'] + 1) / 1e3:.1f} KB",
                f"{r['device_rss']:.0f} MB",
                f"{r['agg_rss']:.0f} MB",
            ]
        )
    table = markdown_table(
        [
            "N",
            "P",
            "median round",
            "max round",
            "broker bytes/round",
            "vs raw payload",
            "overhead/message",
            "device peak RSS",
            "aggregator peak RSS",
        ],
        rows,
    )
    body = (
        f"{table}\n\nRaw payload through the broker per round = (3N + 1)·4P bytes (N uploads in and out, one "
        "announcement in and N out); `overhead/message` is the excess over it per message.\n\n"
        "Flower 1.42 deployment engine, same set-up, measured by the issue's author on this kind of machine: "
        "≥ 6.3 s per round (~45 s at N = 20), ~130–170 MB per SuperNode, ~380–445 MB per device at peak, "
        "bytes ≈ 1.01–1.04× payload + ~50 KB per device per round.\n"
    )
    print(body)
    if not args.no_write and not args.quick:
        write_result("round_overhead", body)
    return {"results": results, "table": table}


if __name__ == "__main__":
    main()

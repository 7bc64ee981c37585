"""Fleet scale: N virtual devices (``edge-trainer --swarm``, ≤ 4 processes) against one mosquitto
and ``cloud-aggregator serve``, running the zero-compute ``echo`` algorithm with P float32 shared
parameters, and the broker's raw floor in the same run.

Per N: median round time (the aggregator's record: announce → every upload admitted and folded →
new global), aggregator peak RSS and CPU per upload, broker peak RSS and CPU per round, the swarm's
CPU per round, broker bytes per round against the payload ``(3N + 1)·4P``, and the raw floor:
the same processes' worth of plain paho clients (one selector loop per process, as in the swarm)
answering an announcement-sized message with an upload-sized one, no decoding, state or learning.

The swarm's state folders live on tmpfs (``/dev/shm``) where there is one: 10,000 virtual devices
on one disk would measure 10,000 fsyncs per round of that disk, which real devices (one SD card
each) do in parallel.  ``--strategy median`` runs the same with the coordinate-wise median (a
strategy that holds every upload) for the memory comparison.

Each case runs ``--repeats`` times (default 3), each run with fresh processes and (K = 1) its own raw
floor; the table gives the median of each figure and, for the round, the raw floor, their ratio and
the aggregator's CPU per upload, the spread (min–max), with the 1-minute load average over the
case's runs: a single noisy run cannot be read as a target met or missed.

Issue 27's targets: aggregator CPU per 4 kB upload (P = 1k) ≤ 80 µs, per 600 kB upload
(P = 150k) ≤ 1 ms; a 10,000 × 1k round ≤ 2.5 s, beside the raw floor of the same runs.

``--quick`` (the test suite): the mean at N ∈ {4, 40} and the median at N = 40, P = 50k, one
swarm process, no raw floor; it returns the figures so a test can check the memory property
(never times).

The targets on this 2-core machine: 10,000 devices × 1k parameters: a round ≤ 2 s;
1,000 devices × 150k parameters: a round ≤ 1.5× the raw floor; aggregator peak RSS at
N = 10,000 ≤ 1.2× its N = 100 figure for the mean family; where the aggregator is the bottleneck,
K = 2 workers (``--workers 1 2 4``: ``[collect] workers = K``) sustain ≥ 1.6× the uploads per
second of K = 1.  With K ≥ 2 the aggregator's figures are ``serve`` and its workers together (CPU
summed; peak RSS summed over the processes).

A combination whose messages cannot fit in this machine's memory is skipped, and its row says
why: a round holds about ``MEMORY_FACTOR × N × 4P`` bytes at its peak (each device's cached
upload in the swarm, the broker's queue for the aggregator, the aggregator's inbound backlog,
paho's buffers; measured: 3.7 GB at N = 1,000, P = 150k), against ``MemAvailable``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho

from benchmarks.common import markdown_table, progress, study_parser, write_result
from cloud_aggregator.local.broker import (
    LOOPBACK_CONF,
    BrokerProcess,
    free_port,
    interrupt_on_sigterm,
    start_mosquitto,
)
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml
from cloud_aggregator.store.sqlite import SqliteStore
from edge.swarm import SwarmLoop, SwarmSession
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions

#: Devices per swarm process at most, and processes at most (the issue's "at most 4").
PER_PROCESS, MAX_PROCESSES = 2500, 4
#: Peak bytes of a round (swarm + broker + aggregator) per byte of the N uploads (module docstring).
MEMORY_FACTOR = 6
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (``serve``'s aggregator workers)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def hwm_mb(pid: int) -> float:
    """Peak RSS (VmHWM) of a process in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def proc_io(pid: int) -> int:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def mem_available() -> int:
    """``MemAvailable`` of this machine in bytes (``/proc/meminfo``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def does_not_fit(n: int, p: int) -> str | None:
    """Why N devices × P parameters cannot run here (``None``: they fit), computed, not tried."""
    need, have = MEMORY_FACTOR * n * 4 * p, mem_available()
    if need <= have:
        return None
    return (
        f"needs ~{need / 1e9:.0f} GB ({MEMORY_FACTOR} × N × 4P bytes: the uploads in the swarm, "
        f"broker queue and aggregator backlog), {have / 1e9:.0f} GB available"
    )


def split(n: int, processes: int | None) -> list[tuple[int, int]]:
    """``(first, count)`` per swarm process: ≤ PER_PROCESS each, ≤ MAX_PROCESSES."""
    k = processes or min(MAX_PROCESSES, max(1, -(-n // PER_PROCESS)))
    base, extra = divmod(n, k)
    out, first = [], 0
    for i in range(k):
        count = base + (i < extra)
        out.append((first, count))
        first += count
    return out


def broker_for(work: Path, n: int) -> BrokerProcess:
    """mosquitto on loopback with room for a round's burst in the aggregator's queue.

    mosquitto keeps at most ``max_queued_messages`` (default 1,000) QoS 1 messages per client
    beyond the 20 in flight and drops the rest: N uploads and N statuses arrive in one burst.
    """
    port = free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(LOOPBACK_CONF.format(port=port) + f"max_queued_messages {max(1000, 4 * n)}\n")
    return start_mosquitto(port, config=conf)


def swarm_root() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="ioft-swarm-", dir=shm if shm.is_dir() else None))


def start_swarms(broker: str, root: Path, parts: list[tuple[int, int]], log: Path) -> list[subprocess.Popen]:
    # keepalive 60 s: four swarm processes share two cores with the broker and the aggregator,
    # and a device whose PINGRESP waits in a busy loop for 15 s (the default) drops its connection.
    conf = root / "device.toml"
    conf.write_text("keepalive = 60\n")
    procs = []
    with log.open("ab") as out:
        for first, count in parts:
            cmd = [sys.executable, "-m", "edge.cli", "--device", "dev", "--fleet", "test", "--broker", broker]
            cmd += [
                "--state-dir",
                str(root),
                "--simulate",
                "printer",
                "--allow-plaintext",
                "--config",
                str(conf),
            ]
            cmd += ["--log-level", "WARNING", "--swarm", str(count), "--swarm-first", str(first)]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
    return procs


def stop(procs: list[subprocess.Popen], timeout: float = 60.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_case(
    n: int,
    p: int,
    rounds: int,
    warmup: int,
    strategy: str,
    processes: int | None,
    raw: bool,
    workers: int = 1,
) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"ioft-scale-{n}-"))
    root = swarm_root()
    fleet = LocalFleet.start(work, broker=broker_for(work, n))
    swarms: list[subprocess.Popen] = []
    try:
        parts = split(n, processes)
        names = [f"dev{i:05d}" for i in range(n)]
        swarms = start_swarms(fleet.broker_url, root, parts, work / "swarm.log")
        task = {
            "name": "bench",
            "algorithm": "echo",
            "model": "vector",
            "rounds": warmup + rounds + 1,  # one more: the aggregator still runs at the last snapshot
            "model_args": {"size": p},
        }
        if strategy != "mean":
            task["server"] = {"reducer": strategy}
        toml = aggregator_toml(
            fleet.broker_url,
            work / "aggregator",
            [task],
            expected=names,
            deadline_s=600,
            startup_wait_s=1800,
            settings={"max_payload_bytes": 16777216},
        )
        if workers > 1:
            toml = toml.replace("[collect]\n", f"[collect]\nworkers = {workers}\n")
        agg = fleet.start_aggregator(toml, log_level="WARNING")
        broker_pid, db = fleet.broker.proc.pid, work / "aggregator" / "aggregator.sqlite"
        start = end = None
        monitor: SqliteStore | None = None
        while agg.poll() is None:
            if monitor is None and db.exists():
                monitor = SqliteStore(db, readonly=True)
            done = monitor.round_count("bench") if monitor is not None else 0
            if start is None and done >= warmup:
                start = snapshot(agg.pid, broker_pid, swarms, done)
            if end is None and done >= warmup + rounds:
                end = snapshot(agg.pid, broker_pid, swarms, done)
            time.sleep(0.005)
        if monitor is not None:
            monitor.close()
        if agg.returncode != 0 or start is None or end is None:
            raise RuntimeError(f"aggregator failed ({agg.returncode}): {fleet.log('aggregator')[-2000:]}")
        store = SqliteStore(db, readonly=True)
        recs = [r for r in store.rounds("bench") if warmup < r.round <= warmup + rounds]
        store.close()
        thin = [r.round for r in recs if len(r.participants) != n]
        if thin:
            raise RuntimeError(f"rounds {thin} lacked uploads: the figures would measure a deadline")
        k = end["done"] - start["done"]
        out = {
            "n": n,
            "p": p,
            "strategy": strategy,
            "workers": workers,
            "processes": len(parts),
            "round_s": statistics.median(r.finished - r.started for r in recs),
            "agg_rss": end["agg_rss"],
            "agg_cpu_upload_ms": (end["agg_cpu"] - start["agg_cpu"]) / (k * n) * 1e3,
            "broker_rss": end["broker_rss"],
            "broker_cpu_round": (end["broker_cpu"] - start["broker_cpu"]) / k,
            "swarm_cpu_round": (end["swarm_cpu"] - start["swarm_cpu"]) / k,
            "swarm_rss": end["swarm_rss"],
            "broker_bytes": (end["broker_io"] - start["broker_io"]) / k,
            "raw_payload": (3 * n + 1) * 4 * p,
        }
        stop(swarms)
        if raw:
            out |= raw_floor(fleet.broker_url, broker_pid, n, p, parts, rounds)
        return out
    finally:
        stop(swarms)
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def snapshot(agg: int, broker: int, swarms: list[subprocess.Popen], done: int) -> dict:
    team = [agg, *(w for w in children(agg) if Path(f"/proc/{w}").exists())]  # serve and its workers
    return {
        "done": done,
        "agg_cpu": sum(cpu_s(pid) for pid in team),
        "agg_rss": sum(hwm_mb(pid) for pid in team),
        "broker_cpu": cpu_s(broker),
        "broker_rss": hwm_mb(broker),
        "broker_io": proc_io(broker),
        "swarm_cpu": sum(cpu_s(s.pid) for s in swarms),
        "swarm_rss": sum(hwm_mb(s.pid) for s in swarms),
    }


# -- the raw floor: the same messages, no learning -----------------------------------------------
UP_OVERHEAD, DOWN_OVERHEAD = 300, 1200  # bytes around the tensor in an echo upload / announcement


def raw_floor(
    broker: str, broker_pid: int, n: int, p: int, parts: list[tuple[int, int]], rounds: int
) -> dict:
    """Median round time of plain clients: one announcement out to N, N uploads of the same size in."""
    b = BrokerAddress.parse(broker)
    got = 0
    cond = threading.Condition()

    def on_message(client, userdata, msg):
        nonlocal got
        with cond:
            got += 1
            cond.notify()

    hub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="raw-hub")
    hub.on_message = on_message
    hub.connect(b.host, b.port)
    hub.subscribe("raw/up/+", qos=1)
    hub.loop_start()
    procs = []
    for first, count in parts:
        cmd = [sys.executable, "-m", "benchmarks.fleet_scale", "--raw-devices", str(count), "--raw-first"]
        cmd += [str(first), "--raw-broker", broker, "--raw-size", str(4 * p + UP_OVERHEAD)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    try:
        for proc in procs:  # each says "ready" once all its clients are subscribed
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a raw device process failed to start")
        down = bytes(4 * p + DOWN_OVERHEAD)
        times = []
        cpu0, cpu_b0 = sum(cpu_s(x.pid) for x in procs), cpu_s(broker_pid)
        for _ in range(rounds + 1):
            with cond:
                got = 0
            t0 = time.perf_counter()
            hub.publish("raw/down", down, qos=1)
            with cond:
                if not cond.wait_for(lambda: got >= n, timeout=600):  # noqa: B023 (read under cond)
                    raise RuntimeError(f"raw floor: {got}/{n} uploads arrived")
            times.append(time.perf_counter() - t0)
        return {
            "raw_round_s": statistics.median(times[1:]),
            "raw_swarm_cpu_round": (sum(cpu_s(x.pid) for x in procs) - cpu0) / (rounds + 1),
            "raw_broker_cpu_round": (cpu_s(broker_pid) - cpu_b0) / (rounds + 1),
        }
    finally:
        stop(procs)
        hub.loop_stop()
        hub.disconnect()


def raw_devices(count: int, first: int, broker: str, size: int) -> None:
    """A raw device process: ``count`` clients that answer each ``raw/down`` with ``size`` bytes."""
    loop = SwarmLoop()
    b = BrokerAddress.parse(broker)
    sessions = []
    for i in range(first, first + count):
        s = SwarmSession(SessionOptions(b, f"raw-{i}", keepalive=60), loop)
        s.subscribe("raw/down")
        s.start()
        sessions.append((s, f"raw/up/{i}"))
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    payload = bytes(size)
    by_id = {id(s): topic for s, topic in sessions}
    ready = False
    while not stopping.is_set():
        for s in loop.poll(0.05):
            while not s.inbound.empty():
                s.inbound.get_nowait()
                s.client.publish(by_id[id(s)], payload, qos=1)
        if not ready and all(s.connected.is_set() for s, _ in sessions):
            ready = True
            time.sleep(0.5)  # SUBACKs
            for s in loop.poll(0.0):
                s.inbound.queue.clear()
            print("ready", flush=True)


#: Figures whose spread over the runs of a case the table shows (median, min–max).
SPREAD = ("round_s", "raw_round_s", "raw_ratio", "agg_cpu_upload_ms")


def summarize(runs: list[dict], load: list[float]) -> dict:
    """One row from the runs of a case: each figure's median, and the min and max of :data:`SPREAD`."""
    for r in runs:
        if "raw_round_s" in r:
            r["raw_ratio"] = r["round_s"] / r["raw_round_s"]
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
    for key in SPREAD:
        if key in out:
            out[key + "_range"] = (min(r[key] for r in runs), max(r[key] for r in runs))
    out["repeats"], out["load"] = len(runs), (min(load), max(load))
    return out


def spread(r: dict, key: str, fmt: str) -> str:
    """``median (min–max)`` of a figure over a case's runs; ``-`` where the case has none."""
    if key not in r:
        return "-"
    low, high = r.get(key + "_range", (r[key], r[key]))
    return (
        fmt.format(r[key]) if low == high else f"{fmt.format(r[key])} ({fmt.format(low)}–{fmt.format(high)})"
    )


def targets(results: list[dict]) -> str:
    """The issue's targets, each met or not, from this run's figures."""
    done = [r for r in results if "failed" not in r and "skipped" not in r]
    ok = {(r["strategy"], r["n"], r["p"]): r for r in done if r["workers"] == 1}
    lines = []
    for p, bound in ((1_000, 0.080), (150_000, 1.0)):  # issue 27: aggregator CPU per upload
        rows = [r for r in done if r["p"] == p and r["workers"] == 1 and r["strategy"] == "mean"]
        for r in rows:
            low, high = r["agg_cpu_upload_ms"], r["agg_cpu_upload_ms_range"][1]
            met = "met" if high <= bound else "met by the median only" if low <= bound else "not met"
            lines.append(
                f"- Aggregator CPU per {4 * p // 1000:,} kB upload ≤ {bound * 1e3:g} µs (N = {r['n']:,}): "
                f"{r['agg_cpu_upload_ms'] * 1e3:.0f} µs ({r['agg_cpu_upload_ms_range'][0] * 1e3:.0f}–"
                f"{high * 1e3:.0f}), {met}."
            )
    big, small = ok.get(("mean", 10_000, 1_000)), ok.get(("mean", 100, 1_000))
    if big is not None:
        met = "met" if big["round_s"] <= 2.5 else "not met"
        raw = f", raw floor {big['raw_round_s']:.2f} s in the same runs" if "raw_round_s" in big else ""
        lines.append(
            f"- 10,000 devices × 1,000 parameters, a round ≤ 2.5 s (issue 27): {big['round_s']:.2f} s "
            f"({big['round_s_range'][0]:.2f}–{big['round_s_range'][1]:.2f}){raw}, {met}."
        )
    wide = ok.get(("mean", 1_000, 150_000))
    if wide is not None and "raw_round_s" in wide:
        ratio = wide["round_s"] / wide["raw_round_s"]
        met = "met" if ratio <= 1.5 else "not met"
        lines.append(
            f"- 1,000 devices × 150,000 parameters, a round ≤ 1.5× the raw floor: {wide['round_s']:.2f} s "
            f"vs {wide['raw_round_s']:.2f} s, {ratio:.2f}×, {met}."
        )
    if big is not None and small is not None:
        ratio = big["agg_rss"] / small["agg_rss"]
        met = "met" if ratio <= 1.2 else "not met"
        lines.append(
            f"- Aggregator peak RSS at N = 10,000 ≤ 1.2× N = 100 (mean, P = 1,000): {ratio:.2f}×, {met}."
        )
    for r in done:
        one = ok.get((r["strategy"], r["n"], r["p"]))
        if r["workers"] == 2 and one is not None:
            ratio = one["round_s"] / r["round_s"]  # the same N uploads per round: uploads/s ratio
            met = "met" if ratio >= 1.6 else "not met"
            lines.append(
                f"- K = 2 workers ≥ 1.6× the uploads per second of K = 1 (N = {r['n']:,}, P = {r['p']:,}): "
                f"{r['n'] / r['round_s']:,.0f} vs {one['n'] / one['round_s']:,.0f} uploads/s, {ratio:.2f}×, {met}."
            )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> Path | None:
    """Round time against the raw floor, and the aggregator's peak RSS, over N per P (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the table says it all; the plot is a picture of it
        return None
    done = [r for r in results if "round_s" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for (strategy, p, k), marker in zip(
        sorted({(r["strategy"], r["p"], r["workers"]) for r in done}), "osd^v<>*x+", strict=False
    ):
        rows = sorted(
            (r for r in done if (r["strategy"], r["p"], r["workers"]) == (strategy, p, k)),
            key=lambda r: r["n"],
        )
        ns = [r["n"] for r in rows]
        label = f"{strategy}, P = {p:,}" + (f", K = {k}" if k > 1 else "")
        left.plot(ns, [r["round_s"] for r in rows], marker=marker, label=f"round, {label}")
        raw = [(r["n"], r["raw_round_s"]) for r in rows if "raw_round_s" in r]
        if raw:
            left.plot(*zip(*raw, strict=True), marker=marker, linestyle="--", label=f"raw floor, {label}")
        right.plot(ns, [r["agg_rss"] for r in rows], marker=marker, label=label)
    for ax, ylabel in ((left, "median round (s)"), (right, "aggregator peak RSS (MB)")):
        ax.set_xscale("log")
        ax.set_xlabel("devices N")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_yscale("log")
    fig.suptitle("fleet_scale: one mosquitto, one aggregator, a swarm of echo devices")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the table -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--params", type=int, nargs="+", default=[1_000, 150_000])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--strategy", nargs="+", default=["mean"], help="reducers: mean (streams), median")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="aggregator workers K ([collect] workers)"
    )
    parser.add_argument("--processes", type=int, help="swarm processes (default: ≤ 2,500 devices each)")
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="NxP[xK]",
        help="exactly these cases (e.g. 1000x1000x2: N = 1,000, P = 1,000, K = 2 workers) instead of "
        "every combination of --devices, --params and --workers",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each case (fresh processes, its own raw floor each)"
    )
    parser.add_argument("--raw-devices", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--raw-first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--raw-broker", help=argparse.SUPPRESS)
    parser.add_argument("--raw-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_devices:
        raw_devices(args.raw_devices, args.raw_first, args.raw_broker, args.raw_size)
        return {}
    interrupt_on_sigterm()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children (mosquitto, swarms) inherit it
    raw = not args.quick
    if args.quick:
        args.devices, args.params, args.rounds, args.warmup = [4, 40], [50_000], 2, 1
        args.strategy, args.processes, args.repeats = ["mean", "median"], 1, 1
    cases = [
        (s, n, p, k) for s in args.strategy for p in args.params for n in args.devices for k in args.workers
    ]
    if args.cases:
        try:
            picked = [[int(x) for x in c.split("x")] for c in args.cases]
        except ValueError:
            picked = [[]]
        if any(len(c) not in (2, 3) or min(c) < 1 for c in picked):
            parser.error(f"--cases takes NxP or NxPxK with positive integers, got {' '.join(args.cases)}")
        cases = [(s, c[0], c[1], c[2] if len(c) == 3 else 1) for s in args.strategy for c in picked]
    cases = [c for c in cases if c[0] == "mean" or c[3] == 1]  # only the mean family splits over workers
    if args.quick:  # the median at the larger N only: the memory a strategy holding every upload adds
        cases = [("mean", 4, 50_000, 1), ("mean", 40, 50_000, 1), ("median", 40, 50_000, 1)]
    results = []
    for s, n, p, k in progress(cases, "cases"):
        why = does_not_fit(n, p)
        if why is not None:
            results.append({"strategy": s, "n": n, "p": p, "workers": k, "skipped": why})
            continue
        runs = []
        load = [os.getloadavg()[0]]
        try:
            for _ in range(args.repeats):
                runs.append(run_case(n, p, args.rounds, args.warmup, s, args.processes, raw and k == 1, k))
                load.append(os.getloadavg()[0])
        except RuntimeError as exc:  # a case that fails says why in its row; the others stand
            if args.quick:
                raise
            results.append({"strategy": s, "n": n, "p": p, "workers": k, "failed": str(exc)[:300]})
            continue
        results.append(summarize(runs, load))
    rows = [
        [r["strategy"], f"{r['n']:,}", f"{r['p']:,}", r["workers"], f"skipped: {r['skipped']}"] + [""] * 15
        if "skipped" in r
        else [r["strategy"], f"{r['n']:,}", f"{r['p']:,}", r["workers"], f"failed: {r['failed']}"] + [""] * 15
        if "failed" in r
        else [
            r["strategy"],
            f"{r['n']:,}",
            f"{r['p']:,}",
            r["workers"],
            r["processes"],
            f"{r['repeats']} (load {r['load'][0]:.1f}–{r['load'][1]:.1f})",
            spread(r, "round_s", "{:.3f} s"),
            f"{r['n'] / r['round_s']:,.0f}",
            spread(r, "raw_round_s", "{:.3f} s"),
            spread(r, "raw_ratio", "{:.2f}×"),
            f"{r['agg_rss']:.0f} MB",
            spread(r, "agg_cpu_upload_ms", "{:.3f} ms"),
            f"{r['broker_rss']:.0f} MB",
            f"{r['broker_cpu_round']:.2f} s",
            f"{r['raw_broker_cpu_round']:.2f} s" if "raw_broker_cpu_round" in r else "-",
            f"{r['swarm_cpu_round']:.2f} s",
            f"{r['raw_swarm_cpu_round']:.2f} s" if "raw_swarm_cpu_round" in r else "-",
            f"{r['swarm_cpu_round'] / r['n'] * 1e3:.3f} ms",
            f"{r['swarm_rss']:.0f} MB",
            f"{r['broker_bytes'] / r['raw_payload']:.3f}×",
        ]
        for r in results
    ]
    table = markdown_table(
        [
            "strategy",
            "N",
            "P",
            "workers K",
            "swarm procs",
            "runs (1-min load)",
            "round: median (min–max)",
            "uploads/s",
            "raw floor round",
            "round ÷ raw floor",
            "aggregator peak RSS",
            "aggregator CPU/upload",
            "broker peak RSS",
            "broker CPU/round",
            "raw broker CPU/round",
            "swarm CPU/round",
            "raw swarm CPU/round",
            "swarm CPU/device",
            "swarm peak RSS (sum)",
            "broker bytes vs payload",
        ],
        rows,
    )
    body = table + "\n\n" + targets(results)
    print(body)
    if not args.no_write and not args.quick:
        out = write_result("fleet_scale", body)
        plot(results, out.with_suffix(".png"))
    return {"results": results, "table": table}


if __name__ == "__main__":
    main()

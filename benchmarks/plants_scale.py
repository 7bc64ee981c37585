"""Plants at scale: N virtual devices as P plants of N/P, each plant with its own mosquitto bridged to
the cloud broker and its own partial aggregator, all folded by one top aggregator; the same N
straight to the cloud broker (no plants) as the reference of the same run.

Per plant: a loopback mosquitto whose bridge to the cloud broker carries the product's own
``bridge_topic_lines(partial=True)`` (what ``fleet add-plant --partial-aggregator`` writes: statuses
and the plant's batches out, announcements and ``agg/ctl`` in, no device upload), with room for a
round's burst (``max_queued_messages``); ``cloud-aggregator worker --plant --id plant-<i>`` on it;
N/P devices as ``edge-trainer --swarm`` processes (≤ 2,500 devices each) dialling it.  At the cloud:
mosquitto and ``cloud-aggregator serve`` with ``[collect] plant_workers`` (it coordinates and folds
P partial sums; it reads no upload).  The reference (``--flat-max``, default 10,000): the same N
devices, task and swarm split straight to the cloud broker, ``serve`` reading every upload.

Plaintext on loopback, not ``fleet init``'s TLS fleet: a swarm runs every virtual device on one
device config, so one certificate, and the written brokers take the certificate's name as the
client id (``use_username_as_clientid``): the devices of a swarm would knock each other off.  And
``fleet init`` issued 200 devices' certificates and folders in 7.3 s here (~25 min for 40,000).

Per size, from a process-CPU snapshot (``/proc/<pid>/stat``) at every completed round: rounds
completed per minute; each broker's and aggregator's CPU per round (median and min–max over the
measured rounds); peak RSS per device of the swarms, and of the aggregators and brokers; what the
top aggregator receives per round (a counting subscriber on the cloud broker: plant batches,
device uploads, statuses; messages and bytes); each component's share of the machine (CPU seconds
per wall second); the 1-minute load.  A size that does not finish in ``--timeout`` seconds is
stopped and its row says how far it got, which component used the most CPU, and any error its
logs show: what broke first.

    python -m benchmarks.plants_scale --plants 4 --devices 1000 4000 [--params 1000] [--rounds 3]

``--quick`` (the suite): 2 plants × 20 devices and the flat fleet, FedAvg on the simulated printers;
it returns both runs' figures so a test can check the properties (one batch per plant per round at
the top, no upload; the same global as the flat fleet's), never times.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import paho.mqtt.client as paho

from benchmarks.common import markdown_table, progress, study_parser, write_result
from benchmarks.fleet_scale import children, cpu_s, hwm_mb, split, start_swarms, stop, swarm_root
from cloud_aggregator.fleet.plant_files import bridge_identity, bridge_topic_lines
from cloud_aggregator.local.broker import LOOPBACK_CONF, free_port, interrupt_on_sigterm, start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet, aggregator_toml
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import topics

TASK = "bench"
#: Log lines that say something went wrong (the evidence a failed size quotes).
TROUBLE = re.compile(r"Traceback|Error|error|denied|refused|Too many open files|out of memory|dropp", re.I)


def broker_conf(port: int, n: int, cloud_port: int | None = None, plant: str = "") -> str:
    """A loopback mosquitto for ``n`` devices; with ``cloud_port``, a plant bridged to the cloud as
    ``fleet add-plant --partial-aggregator`` bridges it (its own ``bridge_topic_lines``)."""
    # mosquitto keeps max_queued_messages (default 1,000) per client and drops the rest: a round
    # sends the partial aggregator n uploads and n statuses in one burst (fleet_scale.broker_for).
    text = LOOPBACK_CONF.format(port=port) + f"max_queued_messages {max(1000, 4 * n)}\n"
    if cloud_port is None:
        return text
    # Each bridge its own client id at the cloud, as add-plant writes it (mosquitto's default,
    # <hostname>.<connection>, is the same for every plant here: they would knock each other off).
    bridge = [f"connection cloud\naddress 127.0.0.1:{cloud_port}", f"remote_clientid {bridge_identity(plant)}",
              "cleansession false",
              "local_cleansession false", "bridge_protocol_version mqttv311", "restart_timeout 1 2",
              "keepalive_interval 60", *bridge_topic_lines(FLEET, partial=True)]  # fmt: skip
    return text + "\n".join(bridge) + "\n"


class Tally:
    """A subscriber on the cloud broker counting what the top aggregator receives, by kind."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.count: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.statuses: set[int] = set()
        self._lock = threading.Lock()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="plants-scale-tally")
        self.client.on_connect = lambda c, *_a: c.subscribe(f"{topics.PROTOCOL}/{FLEET}/#", qos=1)
        self.client.on_message = self._on_message
        self.client.connect(host, int(port), keepalive=120)
        self.client.loop_start()

    @staticmethod
    def kind(topic: str) -> str:
        if "/agg/batch/" in topic:
            return "batch"
        if "/status/" in topic:
            return "status"
        if "/task/" in topic and "/up/" in topic:
            return "upload"
        if "/task/" in topic and (topic.endswith("/down") or "/down/" in topic):
            return "down"  # the aggregator's own announcements: not work it receives
        return "other"

    def _on_message(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        k = self.kind(msg.topic)
        with self._lock:
            self.count[k] += 1
            self.bytes[k] += len(msg.payload)
            if k == "status":  # a copy delivered twice (QoS 1 over the bridge) is no new status
                self.statuses.add(hash((msg.topic, msg.payload)))
                self.count["status distinct"] = len(self.statuses)

    def read(self) -> tuple[Counter[str], Counter[str]]:
        with self._lock:
            return Counter(self.count), Counter(self.bytes)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Case:
    """The processes of one size: cloud broker and ``serve``, P plants (broker + worker), swarms."""

    def __init__(self, work: Path, n: int, plants: int, task: dict, processes: int | None) -> None:
        self.work, self.n, self.plants = work, n, plants
        self.root = swarm_root()
        port = free_port()
        (work / "cloud.conf").write_text(broker_conf(port, n))
        self.fleet = LocalFleet.start(work, broker=start_mosquitto(port, config=work / "cloud.conf"))
        self.plant_brokers, self.workers, self.swarms = [], [], []
        self.tally: Tally | None = None
        self.cpu_seen: dict[int, float] = {}  # a process that exited between polls keeps its last figure
        self.top_seen: set[int] = set()  # serve and the workers it spawned, once seen
        try:
            self._start(work, n, plants, task, processes, port)
        except BaseException:
            self.stop()
            raise

    def _start(self, work: Path, n: int, plants: int, task: dict, processes: int | None, port: int) -> None:
        self.tally = Tally(self.fleet.broker_url)
        names = [f"dev{i:05d}" for i in range(n)]
        collect = "[collect]\n"
        if plants:
            ids = [f"plant-{i}" for i in range(plants)]
            collect += "plant_workers = [" + ", ".join(f'"{w}"' for w in ids) + "]\n"
        toml = aggregator_toml(
            self.fleet.broker_url, work / "aggregator", [task], expected=names, deadline_s=600,
            startup_wait_s=1800, settings={"max_payload_bytes": 16777216},
        ).replace("[collect]\n", collect)  # fmt: skip
        (work / "aggregator.toml").write_text(toml)
        first = 0
        for i in range(plants or 1):
            count = n // (plants or 1) + (i < n % (plants or 1))
            url = self.fleet.broker_url
            if plants:
                pport = free_port()
                conf = work / f"plant-{i}.conf"
                conf.write_text(broker_conf(pport, count, cloud_port=port, plant=f"plant-{i}"))
                broker = start_mosquitto(pport, config=conf, log_file=work / f"plant-{i}.broker.log")
                self.plant_brokers.append(broker)
                url = broker.url
                self.workers.append(self._worker(f"plant-{i}", url))
            parts = [(first + f, c) for f, c in split(count, processes)]
            self.swarms += start_swarms(url, self.root, parts, work / f"swarm-{i}.log")
            first += count
        self.serve = self.fleet.start_aggregator(toml, log_level="WARNING")

    def _worker(self, wid: str, url: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "cloud_aggregator.cli", "--log-level", "WARNING", "worker", "--plant",
               "--id", wid, "--config", str(self.work / "aggregator.toml"), "--broker", url]  # fmt: skip
        with (self.work / f"{wid}.log").open("ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def pids(self) -> dict[str, list[int]]:
        """Each component's processes (``serve`` with any workers it spawned)."""
        self.top_seen |= {self.serve.pid, *children(self.serve.pid)}
        return {
            "cloud broker": [self.fleet.broker.proc.pid],
            "top aggregator": sorted(self.top_seen),
            "plant brokers": [b.proc.pid for b in self.plant_brokers],
            "plant aggregators": [w.pid for w in self.workers],
            "swarms": [s.pid for s in self.swarms],
        }

    def snapshot(self, done: int) -> dict:
        counts, sizes = self.tally.read()
        snap = {"done": done, "t": time.monotonic(), "count": counts, "bytes": sizes}
        for name, pids in self.pids().items():
            alive = [p for p in pids if Path(f"/proc/{p}").exists()]
            self.cpu_seen |= {p: cpu_s(p) for p in alive}
            snap[name] = sum(self.cpu_seen.get(p, 0.0) for p in pids)
            snap[name + " rss"] = [hwm_mb(p) for p in alive]
        return snap

    def trouble(self) -> str:
        """The first lines that say something went wrong, per log; which processes died."""
        out = []
        for log in sorted(self.work.glob("*.log")):
            bad = [line for line in log.read_text(errors="replace").splitlines() if TROUBLE.search(line)]
            if bad:
                out.append(f"{log.name}: {len(bad)} such lines, first: {bad[0][:160]}")
        for log in sorted(self.work.glob("plant-*.broker.log")):  # how far the connection storm got
            text = log.read_text(errors="replace")
            out.append(f"{log.name}: {text.count('New client connected')} connects, "
                       f"{text.count(' disconnected') + text.count('closed its connection')} disconnects")  # fmt: skip
        dead = [p.args[-1] if p in self.workers else p.pid for p in [*self.workers, *self.swarms] if p.poll()]
        if dead:
            out.append(f"exited: {dead}")
        return "; ".join(out) or "no error in any log"

    def stop(self) -> None:
        stop(self.swarms)
        stop(self.workers)
        if self.tally is not None:
            self.tally.stop()
        self.fleet.stop()
        for b in self.plant_brokers:
            b.stop()
        shutil.rmtree(self.root, ignore_errors=True)


POLL_S = 0.05  # how often the monitor reads the store's round count while ``serve`` runs


def counted(snaps: list[dict]) -> int:
    """Rounds measured between the first and the last snapshot (a poll may see several at once)."""
    return snaps[-1]["done"] - snaps[0]["done"] if snaps else 0


COMPONENTS = ("top aggregator", "cloud broker", "plant aggregators", "plant brokers", "swarms")


def run_case(
    n: int,
    plants: int,
    task: dict,
    rounds: int,
    warmup: int,
    timeout: float,
    processes: int | None,
    finish: bool = False,
) -> dict:
    """One size: wait for ``warmup`` rounds, then measure ``rounds`` (a snapshot at each); with
    ``finish``, let ``serve`` run its task to the end and count everything the top received."""
    work = Path(tempfile.mkdtemp(prefix=f"ioft-plants-{plants}x{n}-"))
    t0 = time.monotonic()
    load = [os.getloadavg()[0]]
    db = work / "aggregator" / "aggregator.sqlite"
    snaps: list[dict] = []
    monitor: SqliteStore | None = None
    first_round_s = None
    case = None
    try:
        case = Case(work, n, plants, task, processes)
        start = case.snapshot(0)
        while case.serve.poll() is None and counted(snaps) < rounds:
            if time.monotonic() - t0 > timeout:
                break
            if monitor is None and db.exists():
                monitor = SqliteStore(db, readonly=True)
            done = monitor.round_count(TASK) if monitor is not None else 0
            if done and first_round_s is None:
                first_round_s = time.monotonic() - t0
            if done >= warmup and (not snaps or done > snaps[-1]["done"]):
                snaps.append(case.snapshot(done))
                load.append(os.getloadavg()[0])
            with contextlib.suppress(subprocess.TimeoutExpired):
                case.serve.wait(POLL_S)
        if case.serve.poll() is not None and counted(snaps) < rounds and db.exists():
            monitor = monitor or SqliteStore(db, readonly=True)
            done = monitor.round_count(TASK)  # serve finished its task since the last poll
            if done and first_round_s is None:
                first_round_s = time.monotonic() - t0  # at most this: the round ended since the last poll
            if done >= warmup and (not snaps or done > snaps[-1]["done"]):
                snaps.append(case.snapshot(done))
        end = case.snapshot(snaps[-1]["done"] if snaps else 0)
        share = {c: (end[c] - start[c]) / (end["t"] - start["t"]) for c in COMPONENTS}
        row = {"n": n, "plants": plants, "swarm_procs": len(case.swarms), "share": share,
               "load": (min(load), max(load)), "first_round_s": first_round_s}  # fmt: skip
        if counted(snaps) < rounds:
            why = (
                f"exit {case.serve.returncode}"
                if case.serve.poll() is not None
                else f"timeout {timeout:.0f} s"
            )
            done = snaps[-1]["done"] if snaps else (monitor.round_count(TASK) if monitor else 0)
            busiest = max(share, key=share.get)
            row["failed"] = (
                f"{why} after {done} rounds ({time.monotonic() - t0:.0f} s); busiest: {busiest} "
                f"({share[busiest]:.2f} CPU-s/s, all: {sum(share.values()):.2f}); {case.trouble()}"
            )
            return row
        store = SqliteStore(db, readonly=True)
        recs = {r.round: r for r in store.rounds(TASK)}
        store.close()
        measured = [recs[k] for k in range(snaps[0]["done"] + 1, snaps[-1]["done"] + 1) if k in recs]
        thin = [r.round for r in measured if len(r.participants) != n]
        if thin:
            row["failed"] = f"rounds {thin} lacked uploads (a deadline, not a round): {case.trouble()}"
            return row
        row |= figures(snaps, measured)
        if finish:
            row |= totals(case, timeout - (time.monotonic() - t0))
        return row
    finally:
        if monitor is not None:
            monitor.close()
        if case is not None:
            case.stop()
        if not os.environ.get("IOFT_KEEP_WORK"):
            shutil.rmtree(work, ignore_errors=True)


def totals(case: Case, timeout: float) -> dict:
    """Once ``serve`` has run its task to the end: every round's global and all the top received."""
    if case.serve.wait(max(1.0, timeout)) != 0:
        raise RuntimeError(f"serve exited {case.serve.returncode}: {case.trouble()}")
    seen = None
    while seen != case.tally.read()[0]:  # the counting subscriber's last messages
        seen = case.tally.read()[0]
        time.sleep(0.5)
    store = SqliteStore(case.work / "aggregator" / "aggregator.sqlite", readonly=True)
    recs = store.rounds(TASK)
    store.close()
    return {"all_globals": [r.global_hash for r in recs], "all_participants": [len(r.participants) for r in recs],
            "total": dict(seen)}  # fmt: skip


def figures(snaps: list[dict], measured: list) -> dict:
    """Per-round deltas between consecutive snapshots: medians and (min, max)."""
    pairs = list(itertools.pairwise(snaps))
    per_round = [(b["done"] - a["done"]) for a, b in pairs]

    def dist(values: list[float]) -> tuple[float, float, float]:
        return statistics.median(values), min(values), max(values)

    out = {
        "rounds": sum(per_round),
        "round_s": dist([r.finished - r.started for r in measured]),
        "rounds_per_min": 60 * sum(per_round) / (snaps[-1]["t"] - snaps[0]["t"]),
        "globals": [r.global_hash for r in measured],
        "share": {c: (snaps[-1][c] - snaps[0][c]) / (snaps[-1]["t"] - snaps[0]["t"]) for c in COMPONENTS},
    }
    for c in COMPONENTS:
        out["cpu " + c] = dist([(b[c] - a[c]) / k for (a, b), k in zip(pairs, per_round, strict=True)])
        out["rss " + c] = snaps[-1][c + " rss"]
    for kind in ("batch", "upload", "status", "status distinct", "other"):
        out["msgs " + kind] = dist(
            [(b["count"][kind] - a["count"][kind]) / k for (a, b), k in zip(pairs, per_round, strict=True)]
        )
        out["bytes " + kind] = statistics.median(
            (b["bytes"][kind] - a["bytes"][kind]) / k for (a, b), k in zip(pairs, per_round, strict=True)
        )
    return out


def task_for(algorithm: str, p: int, rounds: int) -> dict:
    if algorithm == "echo":  # transport only (fleet_scale's): P float32 shared parameters
        return {
            "name": TASK,
            "algorithm": "echo",
            "model": "vector",
            "rounds": rounds,
            "model_args": {"size": p},
        }
    # the simulated printers' data, FedAvg: an exact fold, so the plants' global is the flat fleet's
    return {"name": TASK, "algorithm": "fedavg", "model": "sigmoid_glm", "rounds": rounds,
            "hparams": {"lr": 0.1, "local_steps": 5}}  # fmt: skip


def spread(d: tuple[float, float, float], fmt: str) -> str:
    med, lo, hi = d
    return fmt.format(med) if lo == hi else f"{fmt.format(med)} ({fmt.format(lo)}–{fmt.format(hi)})"


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        where = f"{r['plants']} × {r['n'] // r['plants']:,}" if r["plants"] else "flat (reference)"
        head = [where, f"{r['n']:,}", r["swarm_procs"], f"{r['load'][0]:.1f}–{r['load'][1]:.1f}"]
        if "failed" in r:
            rows.append([*head, f"failed: {r['failed']}"] + [""] * 12)
            continue
        mb = lambda xs: f"{sum(xs):.0f} MB" if xs else "-"  # noqa: E731
        top_in = sum(r["msgs " + k][0] for k in ("batch", "upload", "status", "other"))
        rows.append([
            *head,
            f"{r['rounds_per_min']:.2f}",
            spread(r["round_s"], "{:.2f} s"),
            f"{r['first_round_s']:.0f} s",
            f"{sum(r['rss swarms']) * 1024 / r['n']:.0f} KB",
            f"{mb(r['rss top aggregator'])} / {mb(r['rss plant aggregators'])}",
            f"{mb(r['rss cloud broker'])} / {mb(r['rss plant brokers'])}",
            spread(r["cpu top aggregator"], "{:.2f} s"),
            spread(r["cpu cloud broker"], "{:.2f} s"),
            spread(r["cpu plant aggregators"], "{:.2f} s") if r["plants"] else "-",
            spread(r["cpu plant brokers"], "{:.2f} s") if r["plants"] else "-",
            spread(r["cpu swarms"], "{:.2f} s"),
            f"{r['msgs batch'][0]:.0f} batches, {r['msgs upload'][0]:,.0f} uploads, {r['msgs status'][0]:,.0f} "
            f"statuses ({r['msgs status distinct'][0]:,.0f} distinct; {top_in:,.0f} msgs, {sum(r['bytes ' + k] for k in ('batch', 'upload', 'status', 'other')) / 1e6:.2f} MB)",
            ", ".join(f"{c.split()[0] if c != 'swarms' else c} {v:.2f}" for c, v in r["share"].items()),
        ])  # fmt: skip
    return markdown_table(
        ["layout", "N", "swarm procs", "1-min load", "rounds/min", "round: median (min–max)",
         "first round done after", "swarm peak RSS per device", "aggregator peak RSS: top / plants (sum)",
         "broker peak RSS: cloud / plants (sum)", "top aggregator CPU/round", "cloud broker CPU/round",
         "plant aggregators CPU/round (sum)", "plant brokers CPU/round (sum)", "swarms CPU/round",
         "top receives per round", "CPU-s per wall-s (top, cloud, plant aggs, plant brokers, swarms)"],
        rows,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--plants", type=int, default=4, help="plants P (each N/P devices)")
    parser.add_argument("--devices", type=int, nargs="+", default=[1_000, 4_000], help="total devices N")
    parser.add_argument("--params", type=int, default=1_000, help="P shared float32 parameters (echo)")
    parser.add_argument("--algorithm", choices=["echo", "fedavg"], default="echo")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per size before it is stopped")
    parser.add_argument("--flat-max", type=int, default=10_000, help="run the flat reference up to this N")
    parser.add_argument(
        "--processes", type=int, help="swarm processes per plant (default: ≤ 2,500 devices each)"
    )
    args = parser.parse_args(argv)
    if args.plants < 1 or min(args.devices) < args.plants or args.rounds < 1 or args.warmup < 0:
        parser.error("need --plants >= 1, every --devices >= --plants, --rounds >= 1, --warmup >= 0")
    interrupt_on_sigterm()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children (mosquittos, swarms) inherit it
    if args.quick:
        args.plants, args.devices, args.rounds, args.warmup = 2, [40], 2, 0
        args.algorithm, args.processes, args.flat_max = "fedavg", 1, 40
        args.timeout = min(args.timeout, 240)  # a hung size fails the suite's test, not hangs it
    task = task_for(args.algorithm, args.params, args.warmup + args.rounds + 1)
    cases = [
        (n, pl) for n in args.devices for pl in ((args.plants, 0) if n <= args.flat_max else (args.plants,))
    ]
    results = []
    for n, plants in progress(cases, "sizes"):
        results.append(
            run_case(n, plants, task, args.rounds, args.warmup, args.timeout, args.processes, args.quick)
        )
        if args.quick and "failed" in results[-1]:
            raise RuntimeError(results[-1]["failed"])
    body = table(results)
    print(body)
    if not args.no_write and not args.quick:
        what = f"{args.algorithm}, P = {args.params:,}" if args.algorithm == "echo" else "fedavg, sigmoid_glm"
        write_result(
            "plants_scale", f"Task: {what}; {args.warmup} warm-up round(s), {args.rounds} measured.\n\n{body}"
        )
    return {"results": results, "table": body}


if __name__ == "__main__":
    main()

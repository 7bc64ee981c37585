"""What a round costs: the real aggregator, mosquitto and N ``edge-trainer`` processes
running the zero-compute ``echo`` algorithm with P float32 shared parameters.

Per (N, P): median round wall time over the measured rounds (after a warm-up),
bytes through the broker per round against the raw payload, and peak RSS of one
device process and of the aggregator.  Bytes are read from the broker's
``/proc/<pid>/io`` (socket reads + writes; mosquitto runs without persistence or
logging to disk, so that is all network traffic) at two moments when the broker is idle:
after every device is online and before the aggregator starts, and after the aggregator
has finished its last round and exited.  The window thus holds every round whole; less the
task's closing announcement (retained "done" with the final parameters, read back after the
run: N + 1 PUBLISH packets and their PUBACKs) and divided by the number of rounds run
(warm-up included) it gives bytes per round.  The aggregator's connect, subscriptions and
goodbye (a few hundred bytes) stay in.  (Sampling the counter while rounds ran, as this did
before, caught rounds part-way: 0.87-1.14x of the payload on one setting.)  Per round the broker moves ``(3N + 1)·4P`` payload bytes — N uploads in and out,
one announcement in and N out — of which ``2N·4P`` cross the device links.

Reference (from the issue, measured on this kind of machine): Flower 1.42's
deployment engine never took less than ~6.3 s per round (~45 s at N = 20),
~130–170 MB per SuperNode process, ~380–445 MB per device at peak, bytes ≈
1.01–1.04× the payload plus ~50 KB per device per round.
Targets: ≤ 0.5 s per round at N = 20, P = 150k; a device process ≤ 100 MB;
bytes ≤ 1.05× the payload.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, progress, remove_scratch, study_parser, write_result
from cloud_aggregator.local.broker import interrupt_on_sigterm, start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet, Sniffer, aggregator_toml
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import topics

#: The broker counts as idle once its byte counter has not moved for this long.
QUIET_S = 0.5


def proc_io(pid: int) -> int:
    """Bytes read + written by a process (all file descriptors, sockets included)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def wait_online(url: str, names: list[str], timeout: float = 120.0) -> None:
    """Return once every device's retained status says online (the sniffer is gone again)."""
    sniffer = Sniffer(url)
    want = {topics.topic_status(FLEET, name) for name in names}
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            online = {
                t for t, p in list(sniffer.messages) if t in want and json.loads(p).get("state") == "online"
            }
            if online == want:
                return
            time.sleep(0.05)
        raise RuntimeError(f"devices not online after {timeout} s: {sorted(want - online)}")
    finally:
        sniffer.stop()


def quiet_io(pid: int, quiet_s: float = QUIET_S, timeout: float = 60.0) -> int:
    """The broker's byte counter once it has not moved for ``quiet_s`` (nothing in flight)."""
    deadline = time.monotonic() + timeout
    last, since = proc_io(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = proc_io(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise RuntimeError(f"the broker never went quiet for {quiet_s} s within {timeout} s")


def retained(url: str, topic: str, timeout: float = 30.0) -> tuple[str, bytes]:
    """The retained message on ``topic`` (topic, payload)."""
    sniffer = Sniffer(url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for m in list(sniffer.messages) if m[0] == topic]
            if found:
                return found[-1]
            time.sleep(0.05)
        raise RuntimeError(f"no retained message on {topic} after {timeout} s")
    finally:
        sniffer.stop()


def publish_bytes(topic: str, payload: bytes) -> int:
    """Bytes of one QoS 1 PUBLISH of ``payload`` on ``topic`` and its PUBACK (MQTT 3.1.1)."""
    remaining = 2 + len(topic.encode()) + 2 + len(payload)
    length_bytes = 1 + (remaining >= 128) + (remaining >= 16_384) + (remaining >= 2_097_152)
    return 1 + length_bytes + remaining + 4


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
        broker = fleet.broker
        wait_online(fleet.broker_url, names)
        io_start = quiet_io(broker.proc.pid)  # before the first announcement
        agg = fleet.start_aggregator(toml, log_level="WARNING")
        agg_peak = 0.0
        while agg.poll() is None:
            agg_peak = max(agg_peak, peak_rss_mb(agg.pid))
            time.sleep(0.05)
        if agg.returncode != 0:
            raise RuntimeError(f"aggregator failed: {fleet.log('aggregator')[-2000:]}")
        io_end = quiet_io(broker.proc.pid)  # after the last round's end (the aggregator has exited)
        # The window also holds the task's closing announcement ("done", with the final parameters,
        # retained): read it back and take its N + 1 passes through the broker out of the rounds.
        done_bytes = (n + 1) * publish_bytes(*retained(fleet.broker_url, topics.topic_down(FLEET, "bench")))
        db = work / "aggregator" / "aggregator.sqlite"
        store = SqliteStore(db, readonly=True)
        all_rounds = store.rounds("bench")
        recs = [r for r in all_rounds if warmup < r.round <= warmup + rounds]
        refused = store.rejection_counts("bench")
        store.close()
        thin = [r.round for r in recs if len(r.participants) != n]
        if thin or refused:  # a round that waited for its deadline measures the deadline, not the system
            raise RuntimeError(f"rounds {thin} lacked uploads; refused per device: {refused}")
        if len(all_rounds) != warmup + rounds:
            raise RuntimeError(f"{len(all_rounds)} rounds recorded, {warmup + rounds} expected")
        broker_bytes = (io_end - io_start - done_bytes) / len(all_rounds)
        raw_broker = (3 * n + 1) * 4 * p
        return {
            "n": n,
            "p": p,
            "round_s": statistics.median(r.finished - r.started for r in recs),
            "round_s_max": max(r.finished - r.started for r in recs),
            "broker_bytes": broker_bytes,
            "window_rounds": len(all_rounds),
            "done_bytes": done_bytes,
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
    load_before = os.getloadavg()
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
    load_after = os.getloadavg()
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
        "announcement in and N out); `overhead/message` is the excess over it per message. Broker bytes are "
        "counted from an idle broker before the aggregator starts to an idle broker after it has exited, "
        "so every round is whole; the task's closing announcement (the final parameters, retained, to N "
        f"devices) is taken out and the rest divided by the {args.warmup + args.rounds} rounds run (warm-up "
        "included). The aggregator's connect, subscriptions and goodbye stay in.\n\n"
        f"Load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} CPUs: "
        "round times rise with the load of a shared machine, the byte counts do not.\n\n"
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

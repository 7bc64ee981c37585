"""Ingest CPU: the aggregator process's CPU per 4 kB QoS 1 upload, beside the floors it stands on.

N uploads (1k float32 parameters each, valid ``UpdateMessage``s of one round) are published by a
separate process through a real loopback mosquitto; each case is a fresh subscriber process that
times its own CPU (all its threads: ``time.process_time``) from just before the publisher starts
until the N-th upload is in (``collect``: until the round closed with all N counted):

* ``bare``: a paho subscriber whose ``on_message`` counts (paho's receive and PUBACK alone);
* ``queue``: the same, handing each message to another thread through a ``queue.Queue``;
* ``handoff``: an ``MqttSession`` under ``MqttFleet``, the main thread taking each upload with
  ``MqttFleet.next_message`` and nothing else: paho, the session's hand-off and the fleet's routing;
* ``collect``: ``MqttFleet.collect`` over an ``MqttSession`` with a SQLite store and a streaming
  mean: the aggregator's whole ingest (hand-off, admission, one transaction per batch, fold).

Since the session's owner reads the socket itself (``ioft_protocol.mqtt_loop``), ``handoff`` and
``collect`` run on one thread; the other threads' share is the session's background thread (and
SQLite's none).  A second table prices the inbound queue itself, the hand-over it does per message
when the owner reads (put by paho's ``on_message``, taken by ``get``, on one thread): the session's
``Inbound``, ``queue.Queue`` and ``queue.SimpleQueue``.

``--against REV`` adds ``handoff@REV`` and ``collect@REV``: the same cases with the aggregator code of git revision
``REV`` (exported to a scratch folder), so a change is measured against its baseline in one run.
Cases run interleaved, ``--repeats`` times each; the table gives medians and min–max with the
1-minute load average.  ``--quick`` runs N = 200, one repeat, and checks only that every case
counted every upload (never times).

Issue 35's target (a quiet machine): aggregator CPU per 4 kB upload ≤ 100 µs at N = 1,000.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_result

FLEET, TASK, P = "bench", "t", 1000
CASES = ("bare", "queue", "handoff", "collect")
#: The cases that run the aggregator's code (``--against`` measures them with a baseline's too).
OURS = ("handoff", "collect")
ROOT = Path(__file__).resolve().parent.parent


def _global():
    import numpy as np

    return {"w": np.linspace(-1.0, 1.0, P, dtype=np.float32)}


def _devices(n: int) -> list[str]:
    return [f"d{i:05d}" for i in range(n)]


def _request():
    from cloud_aggregator.aggregation.streaming import RoundFold
    from cloud_aggregator.rounds.types import CollectRequest
    from ioft_protocol import codec
    from trainer_lite.params import param_hash
    from trainer_lite.task import TaskSpec

    g = _global()
    return CollectRequest(
        spec=TaskSpec(TASK, "fedavg", "sigmoid_glm", rounds=3),
        round=1,
        phase="train",
        global_params=g,
        global_hash=param_hash(g),
        downlinks={},
        expected={k: codec.TensorSpec(tuple(v.shape), v.dtype.name) for k, v in g.items()},
        fold=RoundFold(lambda u: float(u.n_samples)),
    )


def publish(port: int, n: int) -> None:
    """The publisher process: N valid uploads, pipelined at QoS 1, then wait for every PUBACK."""
    import numpy as np
    import paho.mqtt.client as paho

    from ioft_protocol import round_messages, topics

    req = _request()
    rng = np.random.default_rng(0)
    msgs = []
    for d in _devices(n):
        params = {"w": (req.global_params["w"] + rng.normal(0, 0.01, P)).astype(np.float32)}
        up = round_messages.UpdateMessage(FLEET, TASK, d, 1, "train", 10, req.global_hash, {}, params)
        msgs.append((topics.topic_up(FLEET, TASK, d), up.encode()))
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="ingest-pub")
    client.max_inflight_messages_set(200)
    client.connect("127.0.0.1", port)
    client.loop_start()
    infos = [client.publish(t, p, qos=1) for t, p in msgs]
    for info in infos:
        info.wait_for_publish(120)
    client.loop_stop()
    client.disconnect()


def _start_publisher(port: int, n: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks.ingest_cpu", "--publish", str(port), "--n", str(n)]
    return subprocess.Popen(cmd, cwd=os.getcwd(), env=os.environ.copy())


def measure(case: str, port: int, n: int) -> None:
    """One case in this process: print ``<µs of CPU per upload> <uploads counted> <µs of it on the
    thread that took the uploads (-1: not measured)>``."""
    if case in OURS:
        us, got, own = _measure_fleet(port, n, collect=case == "collect")
    else:
        us, got, own = _measure_bare(port, n, handoff=case == "queue")
    print(f"{us:.2f} {got} {-1 if own is None else own:.2f}", flush=True)


def _measure_bare(port: int, n: int, handoff: bool) -> tuple[float, int, float | None]:
    import queue

    import paho.mqtt.client as paho

    from ioft_protocol import topics

    got, done = 0, threading.Event()
    q: queue.Queue = queue.Queue()

    def count() -> None:
        nonlocal got
        got += 1
        if got >= n:
            done.set()

    def consumer() -> None:
        while True:
            q.get()
            count()

    def on_message(client, userdata, msg) -> None:
        if handoff:
            q.put(msg)
        else:
            count()

    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"ingest-{os.getpid()}")
    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.subscribe(topics.topic_up_all(FLEET, TASK), qos=1)
    client.loop_start()
    time.sleep(0.3)  # SUBACK
    if handoff:
        threading.Thread(target=consumer, daemon=True).start()
    t0 = time.process_time()
    pub = _start_publisher(port, n)
    done.wait(300)
    cpu = time.process_time() - t0
    pub.wait()
    client.loop_stop()
    client.disconnect()
    return cpu / max(1, got) * 1e6, got, None


def _measure_fleet(port: int, n: int, collect: bool) -> tuple[float, int, float]:
    from cloud_aggregator.aggregation.update import Update
    from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
    from cloud_aggregator.store.sqlite import SqliteStore
    from ioft_protocol.mqtt import MqttSession
    from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions

    work = Path(tempfile.mkdtemp(prefix="ingest-cpu-"))
    session = MqttSession(
        SessionOptions(BrokerAddress("127.0.0.1", port, False), f"agg-{os.getpid()}", keepalive=60)
    )
    session.start()
    store = SqliteStore(work / "aggregator.sqlite")
    policy = CollectPolicy(deadline_s=300, expected=tuple(_devices(n)), max_extensions=0)
    fleet = MqttFleet(session, FLEET, policy, store)
    time.sleep(0.3)  # SUBACK
    req = _request()
    t0, own0 = time.process_time(), time.thread_time()
    pub = _start_publisher(port, n)
    if collect:
        out = fleet.collect(req)
        cpu, own = time.process_time() - t0, time.thread_time() - own0
        got = sum(isinstance(u, Update) for u in out)
    else:
        got = 0
        while got < n and fleet.next_message(TASK, 60) is not None:
            got += 1
        cpu, own = time.process_time() - t0, time.thread_time() - own0
    pub.wait()
    session.stop()
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    return cpu / max(1, got) * 1e6, got, own / max(1, got) * 1e6


def queue_costs(repeats: int) -> list[list[str]]:
    """µs per message of each inbound queue's put and take on one thread (median of ``repeats``)."""
    import queue
    import timeit

    from ioft_protocol.mqtt_inbound import Inbound, Message

    msg = Message("t", b"x", False)

    def inbound_get():  # the session's get(): a non-empty queue is popped without a lock
        q = Inbound(10_000)
        return q.put_nowait, q.queue.popleft

    def std(q):
        return q.put_nowait, q.get_nowait

    makers = {
        "Inbound (the session's)": inbound_get,
        "queue.Queue": lambda: std(queue.Queue(10_000)),
        "queue.SimpleQueue": lambda: std(queue.SimpleQueue()),
    }
    rows = []
    for name, make in makers.items():
        put, take = make()

        def run(put=put, take=take) -> None:
            for _ in range(1000):
                put(msg)
                take()

        times = [timeit.timeit(run, number=20) / 20 / 1000 * 1e6 for _ in range(repeats)]
        rows.append([name, f"{statistics.median(times):.3f}", f"{min(times):.3f}–{max(times):.3f}"])
    return rows


def _export(rev: str) -> Path:
    """The tree of ``rev`` in a scratch folder, with this probe in it (the baseline may lack it)."""
    where = Path(tempfile.mkdtemp(prefix="ingest-cpu-base-"))
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    shutil.copy(Path(__file__), where / "benchmarks" / "ingest_cpu.py")
    return where


def run_case(case: str, port: int, n: int, tree: Path) -> tuple[float, int, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "benchmarks.ingest_cpu", "--case", case, "--port", str(port), "--n", str(n)]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"case {case} failed: {out.stderr[-2000:]}")
    us, got, own = out.stdout.split()[-3:]
    return float(us), int(got), float(own)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="uploads per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--against", metavar="REV", help="also measure collect with the code of this git revision"
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--publish", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.publish is not None:
        publish(args.publish, args.n)
        return {}
    if args.case is not None:
        measure(args.case, args.port, args.n)
        return {}
    if args.quick:
        args.n, args.repeats = 200, 1
    from cloud_aggregator.local.broker import LOOPBACK_CONF, free_port, start_mosquitto

    work = Path(tempfile.mkdtemp(prefix="ingest-cpu-"))
    port = free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(LOOPBACK_CONF.format(port=port) + f"max_queued_messages {max(1000, 2 * args.n)}\n")
    broker = start_mosquitto(port, config=conf)
    trees = {case: ROOT for case in CASES}
    if args.against:
        base = _export(args.against)
        trees = {c: ROOT for c in CASES if c not in OURS}
        for case in OURS:
            trees[case], trees[f"{case}@{args.against}"] = ROOT, base
    figures: dict[str, list[float]] = {c: [] for c in trees}
    owns: dict[str, list[float]] = {c: [] for c in trees}
    loads = []
    try:
        for r in range(args.repeats):
            for case, tree in trees.items():
                us, got, own = run_case(case.split("@")[0], port, args.n, tree)
                if got != args.n:
                    raise RuntimeError(f"case {case} counted {got} of {args.n} uploads")
                figures[case].append(us)
                owns[case].append(own)
                loads.append(os.getloadavg()[0])
                print(f"repeat {r + 1} {case}: {us:.1f} µs/upload", file=sys.stderr, flush=True)
    finally:
        broker.proc.terminate()
        broker.proc.wait(10)
        for tree in set(trees.values()) - {ROOT}:
            shutil.rmtree(tree, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        [
            case,
            f"{statistics.median(v):.1f}",
            f"{min(v):.1f}–{max(v):.1f}",
            f"{statistics.median(v) / statistics.median(figures['bare']):.2f}×",
            f"{statistics.median(owns[case]):.1f}" if min(owns[case]) >= 0 else "",
            f"{statistics.median(v) - statistics.median(owns[case]):.1f}" if min(owns[case]) >= 0 else "",
        ]
        for case, v in figures.items()
    ]
    headers = ["case", "CPU µs / upload (median)", "min–max", "× bare paho", "taking thread", "other threads"]
    table = markdown_table(headers, rows)
    queues = markdown_table(
        ["inbound queue", "µs / message (median)", "min–max"], queue_costs(max(5, args.repeats))
    )
    body = (
        f"N = {args.n} uploads of 4 kB (P = {P} float32), QoS 1, one loopback mosquitto, {args.repeats} "
        f"interleaved repeats; 1-minute load average over the runs {min(loads):.2f}–{max(loads):.2f}. "
        "Taking thread: the CPU of the thread that took the uploads (``next_message`` / ``collect``), "
        "the other threads' (the session's background thread; at a baseline from before "
        "``ioft_protocol.mqtt_loop``, paho's network thread) is the rest (medians).\n\n"
        f"{table}\n\nTarget (issue 35, a quiet machine): collect ≤ 100 µs per upload at N = 1,000.\n\n"
        "The inbound queue's own cost per message, put then taken on one thread (the owner reads the "
        f"socket), 1,000 messages × 20, {max(5, args.repeats)} repeats:\n\n{queues}"
    )
    print(body)
    if not args.no_write and not args.quick:
        write_result("ingest_cpu", body)
    return figures


if __name__ == "__main__":
    main()

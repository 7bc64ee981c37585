"""Ingest thread: the collecting thread's own CPU per 4 kB upload, in process (no broker, no paho).

``MqttFleet.collect`` over a fake session that hands back N queued uploads (1k float32
parameters each, valid ``UpdateMessage``s of one round, already encoded), with a SQLite store
and a streaming mean: the aggregator's whole ingest after the socket (routing, decode, admission,
one transaction per batch, the fold, the checkpoints, filing).  What ``benchmarks.ingest_cpu``'s
``collect`` case calls the taking thread, without the broker, paho and their noise.

Each measurement is a fresh process: a warm-up round of the same N devices (so the norm
reference has its history, as in any round after the first), then the timed round: the CPU of
the process (``time.process_time``; one thread does the work) per upload.  Every device has a
status reporting its training rows (the ``samples`` step reads it).

``--against REV`` measures the same with the aggregator code of git revision ``REV`` (exported to a
scratch folder), interleaved with this tree's, so a change is measured against its baseline in one
run.  ``--profile`` prints a cProfile of one timed round (this tree) instead.  ``--quick`` runs
N = 200, one repeat, and checks only that every upload was counted and that the round's mean has
the bits of folding each upload in arrival order (never times).

Target (issue 35): ≤ 40 µs of collecting-thread CPU per 4 kB upload.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_result

FLEET, TASK, P = "bench", "t", 1000
ROOT = Path(__file__).resolve().parent.parent


# Its own copy of benchmarks.common.QueuedSession: with --against, this file runs inside an older tree.
class _Session:
    """Just enough of ``MqttSession`` for ``MqttFleet``: queued messages come back from ``get``."""

    def __init__(self) -> None:
        from collections import deque

        self.queue: deque = deque()
        self.on_connect_hooks: list = []

    def subscribe(self, topic: str, qos: int = 1) -> None:
        pass

    def publish(self, topic, payload, retain=False, timeout=None) -> None:
        pass

    def get(self, timeout):
        return self.queue.popleft() if self.queue else None


def _devices(n: int) -> list[str]:
    return [f"d{i:05d}" for i in range(n)]


def _request(round_: int, g):
    from cloud_aggregator.aggregation.streaming import RoundFold
    from cloud_aggregator.rounds.types import CollectRequest
    from ioft_protocol import codec
    from trainer_lite.params import param_hash
    from trainer_lite.task import TaskSpec

    return CollectRequest(
        spec=TaskSpec(TASK, "fedavg", "sigmoid_glm", rounds=3),
        round=round_,
        phase="train",
        global_params=g,
        global_hash=param_hash(g),
        downlinks={},
        expected={k: codec.TensorSpec(tuple(v.shape), v.dtype.name) for k, v in g.items()},
        fold=RoundFold(lambda u: float(u.n_samples)),
    )


def _uploads(req, devices: list[str], seed: int) -> tuple[list, list]:
    """``(messages, params)``: each device's upload to ``req``'s round, encoded, and what it holds."""
    import numpy as np

    from ioft_protocol import round_messages, topics
    from ioft_protocol.mqtt_inbound import Message

    rng = np.random.default_rng(seed)
    msgs, sent = [], []
    for d in devices:
        params = {"w": (req.global_params["w"] + rng.normal(0, 0.01, P)).astype(np.float32)}
        up = round_messages.UpdateMessage(
            FLEET, TASK, d, req.round, req.phase, 10, req.global_hash, {"loss": 0.5}, params
        )
        msgs.append(Message(topics.topic_up(FLEET, TASK, d), up.encode(), False))
        sent.append(params)
    return msgs, sent


def measure(n: int, profile: bool = False) -> dict:
    """One timed round in this process: CPU µs per upload, uploads counted, and whether the mean
    has the bits of folding each upload in arrival order."""
    import numpy as np

    from cloud_aggregator.aggregation.streaming import StreamingMean
    from cloud_aggregator.aggregation.update import Update
    from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
    from cloud_aggregator.store.sqlite import SqliteStore
    from ioft_protocol import topics
    from ioft_protocol.mqtt_inbound import Message

    work = Path(tempfile.mkdtemp(prefix="ingest-thread-"))
    devices = _devices(n)
    session = _Session()
    store = SqliteStore(work / "aggregator.sqlite")
    policy = CollectPolicy(deadline_s=300, expected=tuple(devices), max_extensions=0)
    fleet = MqttFleet(session, FLEET, policy, store)
    status = json.dumps({"state": "online", "data": {"train": 100}}).encode()
    for d in devices:
        fleet.handle(Message(topics.topic_status(FLEET, d), status, False))
    g = {"w": np.linspace(-1.0, 1.0, P, dtype=np.float32)}
    warm = _request(1, g)
    session.queue.extend(_uploads(warm, devices, 1)[0])
    fleet.collect(warm)
    req = _request(2, g)
    msgs, sent = _uploads(req, devices, 2)
    session.queue.extend(msgs)
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        out = fleet.collect(req)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        cpu = float("nan")
    else:
        t0 = time.process_time()
        out = fleet.collect(req)
        cpu = time.process_time() - t0
    got = sum(isinstance(u, Update) for u in out)
    one_by_one = StreamingMean()
    for params in sent:
        one_by_one.add(params, 10.0)
    want, have = one_by_one.result()["w"], req.fold.mean.result()["w"]
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    return {"us": cpu / max(1, got) * 1e6, "got": got, "bits": bool(np.array_equal(want, have))}


def _export(rev: str) -> Path:
    """The tree of ``rev`` in a scratch folder, with this probe in it (the baseline may lack it)."""
    where = Path(tempfile.mkdtemp(prefix="ingest-thread-base-"))
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    shutil.copy(Path(__file__), where / "benchmarks" / "ingest_thread.py")
    return where


def run_case(n: int, tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "benchmarks.ingest_thread", "--case", "--n", str(n)]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"case failed in {tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="uploads per round")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--against", metavar="REV", help="also measure the aggregator code of this git revision")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one round, no table")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.n < 1 or args.n > 2000:
        ap.error("--n must be 1 to 2000")
    if args.case:
        print(json.dumps(measure(args.n)), flush=True)
        return {}
    if args.profile:
        measure(args.n, profile=True)
        return {}
    if args.quick:
        args.n, args.repeats = 200, 1
    trees = {"this tree": ROOT}
    if args.against:
        trees[args.against] = _export(args.against)
    figures: dict[str, list[float]] = {c: [] for c in trees}
    loads = []
    try:
        for r in range(args.repeats):
            for case, tree in trees.items():
                got = run_case(args.n, tree)
                if got["got"] != args.n or not got["bits"]:
                    raise RuntimeError(
                        f"{case}: counted {got['got']} of {args.n}, mean bit-exact: {got['bits']}"
                    )
                figures[case].append(got["us"])
                loads.append(os.getloadavg()[0])
                print(f"repeat {r + 1} {case}: {got['us']:.1f} µs/upload", file=sys.stderr, flush=True)
    finally:
        for tree in set(trees.values()) - {ROOT}:
            shutil.rmtree(tree, ignore_errors=True)
    ref = statistics.median(figures["this tree"])
    rows = [
        [
            case,
            f"{statistics.median(v):.1f}",
            f"{min(v):.1f}–{max(v):.1f}",
            f"{statistics.median(v) / ref:.2f}×",
        ]
        for case, v in figures.items()
    ]
    table = markdown_table(["code", "CPU µs / upload (median)", "min–max", "× this tree"], rows)
    body = (
        f"N = {args.n} queued uploads of 4 kB (P = {P} float32) into `MqttFleet.collect` over a fake "
        f"session, SQLite store, streaming mean; {args.repeats} interleaved repeats, each a fresh process "
        f"(a warm-up round, then the timed one); 1-minute load average over the runs "
        f"{min(loads):.2f}–{max(loads):.2f}.\n\n{table}\n\n"
        "Target (issue 35): ≤ 40 µs of collecting-thread CPU per 4 kB upload."
    )
    print(body)
    if not args.no_write and not args.quick:
        write_result("ingest_thread", body)
    return figures


if __name__ == "__main__":
    main()

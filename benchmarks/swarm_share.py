"""Swarm share: the simulated devices' CPU per device-round against the raw swarm and the training alone.

One run of ``fleet_scale``'s case (``edge-trainer --swarm`` processes, one mosquitto, ``cloud-aggregator
serve``, the zero-compute ``echo`` algorithm with P float32 parameters, then the raw swarm: plain paho
clients answering an announcement-sized message with an upload-sized one on the same selector loop)
gives, per repeat, the swarm's and the raw swarm's CPU per device-round.  Beside them, in this process,
the local training steps alone: :func:`edge.round_steps.train` (the call the daemon makes) on one
device's rows, for the same algorithm and P, timed with ``time.thread_time`` over many rounds.

Issue 35's target: swarm CPU per device-round ≤ 2 × the raw swarm's + the training alone.  The table
gives medians of ``--repeats`` runs (default 5) with their spread and the 1-minute load average over
the runs.  CPU time, not wall time: a loaded machine still inflates it (shared cores and caches),
so compare figures of one run: ``--compare-tree DIR`` runs the same cases with another checkout's
code (``git archive <commit>`` unpacked in DIR), interleaved run by run with this one's.
``--big N`` adds one run at N devices (10,000 for the issue) with the CPU of a round split by process:
aggregator, broker and swarm, and the raw swarm's and broker's in the same run.

``--steps`` runs the swarm in this process instead and says where its CPU goes per step of a
device-round (decode, gate, train, encode, persist, publish, status, the network loop), each step
timed with ``time.thread_time`` around the daemon's own methods; with ``--compare-tree`` also with
each tree's code (in a child process), and writes ``results/swarm_share_steps.md``.  ``--state-root DIR``
puts the devices' state folders under DIR (default /dev/shm, where an fsync costs little; a disk's
file system shows what the durable state file costs there).

``--quick`` (the test suite): N = 20, 10 rounds, one run; it returns the figures and asserts orderings only
(the swarm's CPU holds the training's), never a time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.common import markdown_table, progress, study_parser, write_result
from benchmarks.fleet_scale import broker_for, run_case, swarm_root
from cloud_aggregator.local.broker import interrupt_on_sigterm
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml
from cloud_aggregator.store.sqlite import SqliteStore
from edge import round_steps
from edge.cli import config_from_args, parse_args
from edge.daemon import EdgeTrainer
from edge.swarm import Swarm, seed_dataset
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.round_messages import Announcement
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

#: The target's factor on the raw swarm (issue 35).
RAW_FACTOR = 2.0


def device_config(root: Path, broker: str = "mqtt://127.0.0.1:1883"):
    """The config ``fleet_scale`` gives its swarm processes (simulated printer, keepalive 60 s)."""
    conf = root / "device.toml"
    conf.write_text("keepalive = 60\n")
    argv = ["--device", "dev", "--fleet", "test", "--broker", broker, "--state-dir", str(root)]
    argv += ["--simulate", "printer", "--allow-plaintext", "--config", str(conf), "--log-level", "WARNING"]
    return config_from_args(parse_args(argv))


def training_alone(p: int, rounds: int = 400, devices: int = 8) -> float:
    """CPU seconds of one :func:`edge.round_steps.train` call: the echo task at P on a swarm device's rows.

    ``devices`` devices in turn (each its own seeded draw), ``rounds`` calls in all, after one warm-up
    call each; the rows are those a swarm device trains on (a copy of the simulated printer's).
    """
    root = Path(tempfile.mkdtemp(prefix="ioft-share-"))
    try:
        base = device_config(root)
        spec = TaskSpec(
            name="bench", algorithm="echo", model="vector", model_args={"size": p}, rounds=rounds + 2
        )
        spec_json = spec.to_json()
        params = {"v.value": np.zeros(p, dtype=np.float32)}
        ann = Announcement("test", "bench", 1, "train", spec_json, 0.0, param_hash(params), params=params)
        work = []
        for i in range(devices):
            name = f"dev{i:05d}"
            config = replace(base, device=name, state_dir=str(root / name))
            seed_dataset(root / name, root / "dev-template", config)
            trainer = EdgeTrainer(config, session_factory=MqttSession)
            algo = trainer.clients.client(spec_json, trainer.data_meta)
            rows = trainer.task_data(spec_json)
            local = trainer.states.get("bench", spec_json, algo).local
            round_steps.train(algo, name, ann, local, rows)  # warm-up
            work.append((algo, name, local, rows))
        started = time.thread_time()
        for r in range(rounds):
            algo, name, local, rows = work[r % devices]
            round_steps.train(algo, name, replace(ann, round=2 + r // devices), local, rows)
        return (time.thread_time() - started) / rounds
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(
    n: int, p: int, rounds: int, warmup: int, repeats: int, processes: int | None, trees: list[str | None]
) -> list[dict]:
    """``repeats`` runs of the fleet_scale case with its raw swarm per code tree (``None``: this one),
    the trees interleaved run by run; the training alone once per repeat, between them."""
    cases = [{"n": n, "p": p, "code": tree or "this commit", "runs": [], "train": []} for tree in trees]
    load = [os.getloadavg()[0]]
    own, here = os.environ.get("PYTHONPATH"), str(Path(__file__).resolve().parents[1])
    for _ in progress(range(repeats), f"{n:,} × {p:,}"):
        for case, tree in zip(cases, trees, strict=True):
            # The children (swarm, raw swarm, aggregator) import the tree's code: `python -m` puts
            # its working folder first on the path, then PYTHONPATH.
            env = tree if tree is not None else own
            if env is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = env
            try:
                with contextlib.chdir(tree or here):
                    r = run_case(n, p, rounds, warmup, "mean", processes, True)
            finally:
                if own is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = own
            r["swarm_dev_s"] = r["swarm_cpu_round"] / n
            r["raw_dev_s"] = r["raw_swarm_cpu_round"] / n
            case["runs"].append(r)
        train = training_alone(p)
        for case in cases:
            case["train"].append(train)
        load.append(os.getloadavg()[0])
    for case in cases:
        case["load"] = load
    return cases


def median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def us(values: list[float]) -> str:
    mid, low, high = median_range([v * 1e6 for v in values])
    return f"{mid:.0f} µs" if len(values) == 1 else f"{mid:.0f} µs ({low:.0f}–{high:.0f})"


def share_row(case: dict) -> tuple[list[str], dict]:
    """One table row and the case's medians (per device-round, seconds)."""
    runs = case["runs"]
    swarm = statistics.median(r["swarm_dev_s"] for r in runs)
    raw = statistics.median(r["raw_dev_s"] for r in runs)
    train = statistics.median(case["train"])
    bound = RAW_FACTOR * raw + train
    ratios = [
        r["swarm_dev_s"] / (RAW_FACTOR * r["raw_dev_s"] + t) for r, t in zip(runs, case["train"], strict=True)
    ]
    row = [
        case["code"],
        f"{case['n']:,}",
        f"{case['p']:,}",
        f"{len(runs)} (load {min(case['load']):.1f}–{max(case['load']):.1f})",
        us([r["raw_dev_s"] for r in runs]),
        us([r["swarm_dev_s"] for r in runs]),
        us(case["train"]),
        f"{bound * 1e6:.0f} µs",
        "{:.2f} ({:.2f}–{:.2f})".format(*median_range(ratios)),
        "met" if swarm <= bound else "not met",
    ]
    return row, {"swarm": swarm, "raw": raw, "train": train, "bound": bound}


def split_row(case: dict) -> list[str]:
    """The CPU of one round by process (medians): aggregator, broker, swarm; the raw run's broker and swarm."""
    runs, n = case["runs"], case["n"]

    def med(key: str, scale: float = 1.0) -> str:
        return f"{statistics.median(r[key] * scale for r in runs):.2f} s"

    return [
        case["code"],
        f"{n:,}",
        f"{case['p']:,}",
        f"{len(runs)} (load {min(case['load']):.1f}–{max(case['load']):.1f})",
        "{:.2f} s ({:.2f}–{:.2f})".format(*median_range([r["round_s"] for r in runs])),
        "{:.2f} s".format(statistics.median(r["raw_round_s"] for r in runs)),
        med("agg_cpu_upload_ms", n / 1e3),
        med("broker_cpu_round"),
        med("swarm_cpu_round"),
        med("raw_broker_cpu_round"),
        med("raw_swarm_cpu_round"),
    ]


# -- where a device-round's CPU goes (--steps) ----------------------------------------------------
#: (owner, attribute, label): the daemon's steps of a device-round and the loop around them.
STEPS = (
    ("handle", "handle: one downlink, all steps"),
    ("_gate", "  gate (pause, selection, dataset refresh, width)"),
    ("_task_state", "  task state (spec compared)"),
    ("_round_rows", "  rows (+ the global's hash, once per swarm)"),
    ("train", "  train: round_steps.train (the training)"),
    ("kept_state", "  encode the upload (round_steps.kept_state)"),
    ("save_task_state", "  persist the task state (atomic file)"),
    ("encode_arrays", "    its bytes (safetensors, checksums)"),
    ("atomic_write_bytes", "    written: temp file, fsync, renames, folder fsync"),
    ("write", "    staged for the group commit: temp file"),
    ("_publish_upload", "  publish the upload (encode message, outbox, paho)"),
    ("_offer", "  offer to serving"),
    ("_answered", "  answered (count, log, round status)"),
    ("_publish_status", "status published (any step)"),
    ("tick", "tick (1/s per device)"),
    ("commit", "group commit: syncfs, renames, syncfs (once per turn)"),
    ("poll", "loop: select, paho reads and writes"),
)


#: Steps whose function left ``EdgeTrainer`` / ``edge.daemon`` in the edge split: where they live now
#: (``--compare-tree`` runs this file with code from before the split as well as after).
_MOVED = {
    "_task_state": ("edge.task_state", "TaskStates", "get"),
    "_publish_status": ("edge.device_link", "DeviceLink", "publish_status"),
    "save_task_state": ("edge.task_state", None, "save_task_state"),
}


def _where(owner: object, name: str) -> tuple[object, str]:
    """The object and attribute holding step ``name``'s function in the code this process runs."""
    if hasattr(owner, name) or name not in _MOVED:
        return owner, name
    module, cls, attr = _MOVED[name]
    home = importlib.import_module(module)
    return (home if cls is None else getattr(home, cls)), attr


def steps(n: int, p: int, rounds: int, warmup: int, state_root: str | None = None) -> list[float]:
    """Run ``n`` devices in this process against a real aggregator: CPU seconds per device-round of
    each of :data:`STEPS`, then of the swarm's whole thread.  The devices' state folders go under
    ``state_root`` (default: ``fleet_scale``'s, /dev/shm where there is one, where fsync costs little)."""
    import edge.daemon as daemon
    import edge.swarm as swarm_mod
    from ioft_protocol import state

    owners = {"train": daemon.round_steps, "kept_state": daemon.round_steps, "save_task_state": daemon}
    owners["poll"] = swarm_mod.SwarmLoop
    owners["encode_arrays"] = owners["atomic_write_bytes"] = state
    with contextlib.suppress(ImportError):  # a tree from before the swarm's group commit has none
        from edge.group_commit import GroupCommit

        owners["write"] = owners["commit"] = GroupCommit
    total: dict[str, list[float]] = {}
    marks: dict[str, tuple[float, int]] = {}
    originals = []

    def timed(owner, attr, name):
        f = getattr(owner, attr)
        originals.append((owner, attr, f))

        def wrapper(*args, **kwargs):
            if "start" not in marks or "end" in marks:
                return f(*args, **kwargs)
            t0 = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                cell = total.setdefault(name, [0.0, 0])
                cell[0] += time.thread_time() - t0
                cell[1] += 1

        setattr(owner, attr, wrapper)

    for name, _ in STEPS:
        owner, attr = _where(owners.get(name, daemon.EdgeTrainer), name)
        if hasattr(owner, attr):  # a step another tree's code lacks shows 0
            timed(owner, attr, name)
    work = Path(tempfile.mkdtemp(prefix="ioft-steps-"))
    root = (
        swarm_root() if state_root is None else Path(tempfile.mkdtemp(prefix="ioft-swarm-", dir=state_root))
    )
    fleet = LocalFleet.start(work, broker=broker_for(work, n))
    try:
        swarm = Swarm(device_config(root, fleet.broker_url), n, 0)
        task = {"name": "bench", "algorithm": "echo", "model": "vector", "model_args": {"size": p}}
        task["rounds"] = warmup + rounds + 1
        names = [f"dev{i:05d}" for i in range(n)]
        toml = aggregator_toml(
            fleet.broker_url, work / "aggregator", [task], expected=names, deadline_s=600, startup_wait_s=1800
        )
        agg = fleet.start_aggregator(toml, log_level="WARNING")
        db, done = work / "aggregator" / "aggregator.sqlite", [0]

        def watch() -> None:  # the rounds the aggregator recorded, off the swarm's thread
            store = None
            while agg.poll() is None:
                if store is None and db.exists():
                    store = SqliteStore(db, readonly=True)
                done[0] = store.round_count("bench") if store is not None else 0
                time.sleep(0.01)
            done[0] = 1 << 30

        def until() -> bool:
            if "start" not in marks and done[0] >= warmup:
                marks["start"] = (time.thread_time(), done[0])
            if "start" in marks and done[0] >= warmup + rounds:
                marks["end"] = (time.thread_time(), done[0])
                return True
            return False

        threading.Thread(target=watch, daemon=True).start()
        swarm.run(until)
    finally:
        for owner, name, f in originals:
            setattr(owner, name, f)
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    (c0, d0), (c1, d1) = marks["start"], marks["end"]
    device_rounds = (d1 - d0) * n
    return [total.get(name, [0.0, 0])[0] / device_rounds for name, _ in STEPS] + [(c1 - c0) / device_rounds]


#: Runs this file's --steps with another tree's code first on the path (its cwd: ``-c`` puts it first).
_RUN_HERE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def steps_in(
    tree: str, n: int, p: int, rounds: int, warmup: int, state_root: str | None = None
) -> list[float]:
    """:func:`steps` in a child process running ``tree``'s code (this benchmark's file, its imports)."""
    cmd = [sys.executable, "-c", _RUN_HERE, __file__, "--steps", "--json", "--no-write"]
    cmd += ["--devices", str(n), "--params", str(p), "--rounds", str(rounds), "--warmup", str(warmup)]
    cmd += [] if state_root is None else ["--state-root", state_root]
    env = os.environ | {"PYTHONPATH": tree}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"--steps with {tree}'s code failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1_000)
    parser.add_argument("--params", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--processes", type=int, help="swarm processes (default: fleet_scale's split)")
    parser.add_argument(
        "--big", type=int, metavar="N", help="one more case at N devices (10000), split by process"
    )
    parser.add_argument("--steps", action="store_true", help="where a device-round's CPU goes, per step")
    parser.add_argument(
        "--state-root", metavar="DIR", help="--steps: the devices' state folders under DIR (default /dev/shm)"
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # steps_in's child
    parser.add_argument(
        "--compare-tree",
        nargs="*",
        default=[],
        metavar="DIR",
        help="also run the same cases with another checkout's code (e.g. an older commit's `git archive`), "
        "interleaved run by run with this one's",
    )
    args = parser.parse_args(argv)
    if min(args.devices, args.params, args.rounds, args.repeats) < 1 or args.warmup < 0:
        parser.error("--devices, --params, --rounds and --repeats take positive integers, --warmup ≥ 0")
    interrupt_on_sigterm()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children (mosquitto, swarms) inherit it
    if args.quick:
        # 10 rounds: the swarm's CPU (read in 10 ms clock ticks) is ~5 ticks, never 0 (2 rounds read 0 once).
        args.devices, args.rounds, args.warmup, args.repeats, args.processes = 20, 10, 1, 1, 1
    if args.steps:
        load = [os.getloadavg()[0]]
        trees = [None, *args.compare_tree]
        if args.json:  # a child of steps_in: one run in this process
            columns = [steps(args.devices, args.params, args.rounds, args.warmup, args.state_root)]
        else:  # each tree in a child process, the trees interleaved run by run: medians of the runs
            here = str(Path(__file__).resolve().parents[1])
            runs = {tree: [] for tree in trees}
            for _ in progress(range(args.repeats), "steps"):
                for tree in trees:
                    runs[tree].append(
                        steps_in(
                            tree or here, args.devices, args.params, args.rounds, args.warmup, args.state_root
                        )
                    )
                    load.append(os.getloadavg()[0])
            columns = [[statistics.median(col) for col in zip(*runs[tree], strict=True)] for tree in trees]
        if args.json:
            print(json.dumps(columns[0]))
            return {"steps": columns[0]}
        labels = [label for _, label in STEPS] + ["the swarm's thread, all of it"]
        rows = [[label, *(f"{c[i] * 1e6:.1f} µs" for c in columns)] for i, label in enumerate(labels)]
        body = (
            f"CPU per device-round by step (medians of {args.repeats} runs per tree, the trees interleaved), "
            f"N = {args.devices:,}, P = {args.params:,}, {args.rounds} rounds a run, "
            f"1-min load {min(load):.1f}–{max(load):.1f}, state folders under {args.state_root or 'fleet_scale.swarm_root()'}\n\n"
        )
        body += markdown_table(["step of a device-round", "this commit", *args.compare_tree], rows)
        print(body)
        if not args.no_write and not args.quick:
            write_result(
                "swarm_share_steps",
                body,
                command="python -m benchmarks.swarm_share " + " ".join(sys.argv[1:]),
            )
        return {"steps": columns}
    trees = [None, *args.compare_tree]
    cases = measure(args.devices, args.params, args.rounds, args.warmup, args.repeats, args.processes, trees)
    if args.big:
        cases += measure(args.big, args.params, args.rounds, args.warmup, 1, None, trees)
    shares = [share_row(c) for c in cases]
    table = markdown_table(
        [
            "code",
            "N",
            "P",
            "runs (1-min load)",
            "raw swarm CPU/device-round",
            "swarm CPU/device-round",
            "training alone",
            "target: 2 × raw + training",
            "swarm ÷ target",
            "target",
        ],
        [row for row, _ in shares],
    )
    split = markdown_table(
        [
            "code",
            "N",
            "P",
            "runs (1-min load)",
            "round",
            "raw floor round",
            "aggregator CPU/round",
            "broker CPU/round",
            "swarm CPU/round",
            "raw broker CPU/round",
            "raw swarm CPU/round",
        ],
        [split_row(c) for c in cases],
    )
    body = f"{table}\n\nCPU of one round by process (medians):\n\n{split}\n"
    print(body)
    if not args.no_write and not args.quick:
        write_result("swarm_share", body)
    figures = [
        fig | {"n": c["n"], "p": c["p"], "code": c["code"]} for c, (_, fig) in zip(cases, shares, strict=True)
    ]
    return {"cases": figures, "table": table, "json": json.dumps(figures)}


if __name__ == "__main__":
    main()

"""Crash safety against real processes: the aggregator SIGKILLed and restarted ends bit-identical;
the fleet's faults (a device killed, the broker restarted, stragglers, a device offline for
rounds, thin rounds) lose no update; a device killed mid state-write never leaves corrupt state.

Aggregator trials (mosquitto, ``cloud-aggregator serve`` and three ``edge-trainer``
daemons, reused across trials): per seeded trial a PFL-DA task runs once
uninterrupted and once (same seeds, another task name) with 2–4 planned SIGKILLs of
the aggregator (fewer land when the run finishes before a kill is due), each followed
by a restart.  A kill lands either at a named point
(``cloud_aggregator.faults``: after an upload is stored, before/after aggregation,
after the new global's artifact is written, inside the round's open transaction,
after the commit, after an announcement) on a random pass, or at a uniformly random
time of the run.  A trial passes when every round completed, every round aggregated
each device's update exactly once, and every round's global — the final one
included — is bit-identical to the uninterrupted run's and to the in-process
simulation's.  The devices' updates are deterministic in (seed, device, round,
phase) and the aggregator sums them in device order, which is what makes that
comparison exact.

Fleet fault scenarios: each of ``checks.fault_scenarios.SCENARIOS``, ``--scenario-trials``
times, on a fresh broker and fleet; every upload on the wire must be counted or refused
with a recorded reason, none lost.

Device trials: a process looping the daemon's own state write
(``edge.task_state.save_task_state``: temp file, fsync, rename, ``.prev`` kept) is
SIGKILLed at a random time; the state must then load verified and consistent
(every array equals the counter in its metadata), from the new copy or the previous one.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import markdown_table, progress, write_result
from checks.fault_scenarios import DEVICES, SCENARIOS, ScenarioRun
from cloud_aggregator import faults
from cloud_aggregator.local.broker import interrupt_on_sigterm, start_mosquitto
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml, pflda_task
from cloud_aggregator.store.sqlite import SqliteStore
from trainer_lite.params import param_hash

# Passes per run of each point (rounds R, devices N): used to draw where a targeted kill lands.
POINT_PASSES = {
    "after_announce": lambda r, n: r,
    "after_store_update": lambda r, n: r * n,
    "before_aggregate": lambda r, n: r,
    "after_aggregate": lambda r, n: r,
    "after_artifact": lambda r, n: r,
    "before_commit": lambda r, n: r,
    "after_save": lambda r, n: r,
}
if set(POINT_PASSES) != set(faults.POINTS):
    raise RuntimeError("every fault point needs a pass count in POINT_PASSES")


def wait_log(log: Path, offset: int, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Block until ``text`` appears in ``log`` past ``offset`` (or ``proc`` exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with log.open("rb") as fh:
            fh.seek(offset)
            if text.encode() in fh.read():
                return
        time.sleep(0.01)


def read_run(db: Path, task: str) -> tuple[list, str | None]:
    """The round records and the final global's hash of a task in an aggregator store."""
    store = SqliteStore(db, readonly=True)
    try:
        point = store.resume_point(task)
        return store.rounds(task), None if point is None else param_hash(point[2])
    finally:
        store.close()


@functools.cache
def _simulated_data(device: str) -> tuple:
    """The device's simulated dataset, as its trainer makes it: the same for every trial, and
    its simulated I2C bus takes ~1 s a device, so it is made once per process."""
    from edge.config import DataConfig
    from edge.simulated import simulated_printer_dataset

    train, test, _ = simulated_printer_dataset(device, DataConfig(source="simulate-printer"))
    return train, test


def simulated_hashes(task: dict) -> list[str]:
    """Every round's global hash of the same task in the in-process simulator (same code, no MQTT)."""
    from cloud_aggregator.rounds.simulation import ClientData, simulate
    from trainer_lite.task import TaskSpec

    clients = {}
    for d in DEVICES:
        train, test = _simulated_data(d)
        clients[d] = ClientData(copy.deepcopy(train), copy.deepcopy(test))  # a run never alters the cache
    _, _, records = simulate(TaskSpec.from_json(json.dumps(task)), clients)
    return [r.global_hash for r in records]


# -- aggregator trials ------------------------------------------------------------------------------
@dataclass
class CrashTrial:
    seed: int
    plan: list[str]
    injected: list[str] = field(default_factory=list)  # kills that hit a running aggregator
    restarts: int = 0
    rounds: int = 0
    completed: int = 0
    aggregated: int = 0  # updates counted over all rounds
    expected: int = 0  # rounds × devices
    doubled: int = 0
    restored: int = 0  # uploads read back from the store after a restart
    identical: bool = False
    matches_sim: bool = False
    wall_s: float = 0.0

    @property
    def lost(self) -> int:
        return self.expected - self.aggregated

    @property
    def ok(self) -> bool:
        return (
            self.identical
            and self.matches_sim
            and self.lost == 0
            and self.doubled == 0
            and self.completed == self.rounds
        )


class CrashBench:
    """A broker and the devices, kept across trials (each trial uses fresh task names)."""

    def __init__(self, work: Path, *, deadline_s: float = 120.0, checkpoint_every: int | None = None) -> None:
        self.work = work
        self.deadline_s = deadline_s
        self.checkpoint_every = checkpoint_every  # [collect] checkpoint_every (None: the default)
        work.mkdir(parents=True, exist_ok=True)
        self.fleet = LocalFleet.start(work, broker=start_mosquitto(log_file=work / "mosquitto.log"))
        self.fleet.start_devices(DEVICES, "--log-level", "WARNING")

    def close(self) -> None:
        self.fleet.stop()

    def _config(self, name: str, task: dict) -> tuple[str, Path, Path]:
        """The aggregator TOML of a trial's task, its log and its store (in ``work/<name>/``)."""
        folder = self.work / name
        # Every device is awaited; the deadline only bounds a hang, so who took part is deterministic.
        toml = aggregator_toml(
            self.fleet.broker_url,
            folder / "state",
            [task],
            expected=list(DEVICES),
            deadline_s=self.deadline_s,
            min_participants=len(DEVICES),
            startup_wait_s=120,
        )
        if self.checkpoint_every is not None:
            toml = toml.replace("[collect]\n", f"[collect]\ncheckpoint_every = {self.checkpoint_every}\n", 1)
        return toml, folder / "aggregator.log", folder / "state" / "aggregator.sqlite"

    def run_clean(self, task: dict, timeout: float = 300) -> tuple[list, str | None, float]:
        toml, log, db = self._config(task["name"], task)
        started = time.monotonic()
        proc = self.fleet.start_aggregator(toml, name=f"{task['name']}/aggregator")
        rc = proc.wait(timeout)
        wall = time.monotonic() - started
        if rc != 0:
            raise RuntimeError(f"uninterrupted run failed ({rc}):\n{log.read_text()[-3000:]}")
        records, final = read_run(db, task["name"])
        return records, final, wall

    def trial(
        self, seed: int, rounds: int, plan: list[str] | None = None, timeout: float = 300
    ) -> CrashTrial:
        """One seeded trial; ``plan`` (``point:n`` or ``time:<s>`` items) overrides the random one.

        A random plan has 2–4 kills, each drawn when it is due, among the rounds still to run:
        a named point on one of its remaining passes, or (one in four) a kill from outside at a
        uniformly random time of the remaining rounds, counted from "devices online".
        """
        rng = np.random.default_rng(seed)
        ref_task = pflda_task(f"ref{seed}", seed, rounds)
        ref_records, ref_final, _ = self.run_clean(ref_task, timeout)
        rounds_wall = ref_records[-1].finished - ref_records[0].started
        task = pflda_task(f"crash{seed}", seed, rounds)
        toml, log, db = self._config(task["name"], task)
        n_kills = len(plan) if plan is not None else int(rng.integers(2, 5))
        out = CrashTrial(seed, [], rounds=rounds)
        started = time.monotonic()
        for k in range(n_kills + 1):  # the last start runs to the end
            left = rounds - (len(read_run(db, task["name"])[0]) if db.exists() else 0)
            if k == n_kills or left == 0:
                item = None
            elif plan is not None:
                item = plan[k]
            elif rng.random() < 0.25:
                item = f"time:{rng.uniform(0.0, rounds_wall * left / rounds):.3f}"
            else:
                point = str(rng.choice(sorted(POINT_PASSES)))
                item = f"{point}:{int(rng.integers(1, POINT_PASSES[point](left, len(DEVICES)) + 1))}"
            if item is not None:
                out.plan.append(item)
            fault = item if item and not item.startswith("time:") else None
            offset = log.stat().st_size if log.exists() else 0
            proc = self.fleet.start_aggregator(toml, fault=fault, name=f"{task['name']}/aggregator")
            if item is not None and item.startswith("time:"):
                wait_log(log, offset, "devices online", proc, timeout)  # rounds start now
                try:
                    proc.wait(float(item.split(":")[1]))
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
            rc = proc.wait(timeout)
            if rc == 0:
                break  # done (a planned kill that did not land before the end is not counted)
            if rc != -signal.SIGKILL:
                raise RuntimeError(f"aggregator failed ({rc}):\n{log.read_text()[-3000:]}")
            out.injected.append(str(item))
            out.restarts += 1
        out.wall_s = time.monotonic() - started
        records, final = read_run(db, task["name"])
        out.completed = sum(r.status == "completed" for r in records)
        out.aggregated = sum(len(r.participants) for r in records)
        out.expected = rounds * len(DEVICES)
        out.doubled = sum(len(r.participants) - len(set(r.participants)) for r in records)
        out.restored = sum(
            int(n) for n in re.findall(r"(\d+) uploads restored from the store", log.read_text())
        )
        same_rounds = [r.global_hash for r in records] == [r.global_hash for r in ref_records]
        out.identical = final is not None and final == ref_final and same_rounds
        out.matches_sim = [r.global_hash for r in records] == simulated_hashes(task)
        return out


# -- device state-write trials ---------------------------------------------------------------------
def _write_forever(path: Path, size: int) -> None:
    """The daemon's own state write, in a loop, each state marked by its counter ``i``."""
    from edge.task_state import TaskState, save_task_state

    i = 0
    while True:
        i += 1
        v = np.full(size, float(i), np.float32)
        state = TaskState(
            spec_json="{}",
            local={"enc": v},
            answered=(i, "main"),
            upload={"dec": v[: size // 2]},
            upload_meta={"n_samples": i, "global_hash": "x"},
            metrics={"i": float(i)},
        )
        save_task_state(path, state)


def state_trial(work: Path, rng: np.random.Generator) -> str:
    """SIGKILL a state-writing process at a random time; ``current``/``previous`` (``, mid-write``)
    or ``corrupt``.

    The writer is forked from this process (already past its imports), so a trial costs its
    random wait, not an interpreter start: hundreds of kills fit in a minute or two.
    """
    from edge.task_state import load_task_state
    from ioft_protocol.state import StateError, decode_arrays

    folder = Path(tempfile.mkdtemp(dir=work, prefix="state-"))
    path = folder / "local.safetensors"
    size = int(rng.integers(10_000, 1_000_000))
    pid = os.fork()
    if pid == 0:  # the child writes until it is killed; it never returns into the caller's code
        try:
            _write_forever(path, size)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(float(rng.uniform(0.0, 0.3)))  # somewhere in a later write, or between writes
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    mid_write = any(p.name.endswith(".tmp") for p in folder.iterdir())
    try:
        decode_arrays(path.read_bytes())
        current = True
    except (OSError, ValueError):
        current = False
    try:
        state = load_task_state(path)
    except StateError:
        return "corrupt"
    if state is None:
        return "corrupt"  # a file existed before the kill: losing it is a failure too
    i = state.answered[0]
    consistent = (
        np.all(state.local["enc"] == i)
        and np.all(state.upload["dec"] == i)
        and state.upload_meta["n_samples"] == i
        and state.metrics["i"] == i
    )
    if not consistent:
        return "corrupt"
    kind = "current" if current else "previous"
    return f"{kind}, mid-write" if mid_write else kind


# -- fleet fault scenarios -----------------------------------------------------------------------------
def scenario_trial(work: Path, name: str) -> ScenarioRun | str:
    """One run of a ``checks.fault_scenarios`` scenario on a fresh broker and fleet;
    the error text when it could not finish."""
    work.mkdir(parents=True)
    broker = start_mosquitto(log_file=work / "mosquitto.log")  # a scenario may restart it: mosquitto only
    with LocalFleet.start(work, broker=broker) as fleet:
        try:
            return SCENARIOS[name](fleet, broker)
        except AssertionError as exc:
            return f"{name}: {str(exc).splitlines()[0]}"


def scenario_rows(runs: dict[str, list[ScenarioRun | str]]) -> tuple[list[list], dict[str, int]]:
    rows, totals = [], Counter()
    for name, trials in runs.items():
        done = [r for r in trials if isinstance(r, ScenarioRun)]
        statuses = sum((r.statuses() for r in done), Counter())
        figures = {
            "trials": len(trials),
            "finished": len(done),
            "faults": sum(len(r.faults) for r in done),
            "completed": statuses["completed"],
            "abandoned": statuses["abandoned"],
            "on_wire": sum(r.on_wire for r in done),
            "counted": sum(r.counted for r in done),
            "late": sum(r.late_counted for r in done),
            "refused": sum(r.refused_late for r in done),
            "lost": sum(r.lost for r in done),
        }
        totals.update(figures)
        wall = statistics.median(r.wall_s for r in done) if done else float("nan")
        rows.append(
            [
                done[0].name if done else name,
                f"{figures['finished']}/{figures['trials']}",
                "; ".join(done[0].faults) if done else "",
                figures["completed"],
                figures["abandoned"],
                figures["on_wire"],
                f"{figures['counted']} ({figures['late']} late)",
                figures["refused"],
                figures["lost"],
                f"{wall:.1f} s",
            ]
        )
    return rows, dict(totals)


# -- the study ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="aggregator crash trials")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per trial")
    parser.add_argument("--state-trials", type=int, default=200, help="device state-write kill trials")
    parser.add_argument("--seed", type=int, default=0, help="first trial seed (trial i uses seed + i)")
    parser.add_argument("--scenario-trials", type=int, default=3, help="runs of each fleet fault scenario")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/")
    args = parser.parse_args(argv)
    interrupt_on_sigterm()  # `finally` stops the broker and the fleet
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ioft-reliability-"))

    bench = CrashBench(work / "fleet")
    trials: list[CrashTrial] = []
    try:
        for i in progress(range(args.trials), "aggregator crash trials"):
            trials.append(bench.trial(args.seed + i, args.rounds))
    finally:
        bench.close()
    scenario_runs: dict[str, list[ScenarioRun | str]] = {name: [] for name in SCENARIOS}
    cases = [(name, i) for i in range(args.scenario_trials) for name in SCENARIOS]
    for name, i in progress(cases, "fleet fault scenarios"):
        scenario_runs[name].append(scenario_trial(work / "scenarios" / f"{name}-{i}", name))
    scenario_table, scen = scenario_rows(scenario_runs)
    scenario_errors = [r for runs in scenario_runs.values() for r in runs if isinstance(r, str)]
    rng = np.random.default_rng(args.seed)
    outcomes = Counter(
        state_trial(work, rng) for _ in progress(range(args.state_trials), "state-write kills")
    )
    wall = time.monotonic() - started
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())

    rows = [
        [
            t.seed,
            ", ".join(t.plan),
            len(t.injected),
            f"{t.completed}/{t.rounds}",
            f"{t.aggregated}/{t.expected}",
            t.lost,
            t.doubled,
            t.restored,
            "yes" if t.identical and t.matches_sim else "NO",
            f"{t.wall_s:.1f} s",
        ]
        for t in trials
    ]
    table = markdown_table(
        [
            "seed",
            "kill plan",
            "kills landed",
            "rounds",
            "updates counted",
            "lost",
            "double",
            "restored",
            "bit-identical",
            "wall",
        ],
        rows,
    )
    injected = Counter(k.split(":")[0] for t in trials for k in t.injected)
    failures = outcomes.get("corrupt", 0)
    summary = markdown_table(
        ["figure", "value"],
        [
            ["aggregator trials (passed)", f"{len(trials)} ({sum(t.ok for t in trials)})"],
            ["aggregator SIGKILLs landed", sum(len(t.injected) for t in trials)],
            ["… by point", ", ".join(f"{k} {v}" for k, v in sorted(injected.items()))],
            ["rounds completed", sum(t.completed for t in trials)],
            [
                "updates counted / expected",
                f"{sum(t.aggregated for t in trials)} / {sum(t.expected for t in trials)}",
            ],
            ["updates lost", sum(t.lost for t in trials)],
            ["updates double counted", sum(t.doubled for t in trials)],
            ["uploads restored from the store after a restart", sum(t.restored for t in trials)],
            [
                "final globals bit-identical to uninterrupted run and simulation",
                sum(t.identical and t.matches_sim for t in trials),
            ],
            [
                "fleet fault scenarios run (finished)",
                f"{scen.get('trials', 0)} ({scen.get('finished', 0)})",
            ],
            ["… faults injected", scen.get("faults", 0)],
            ["… rounds completed / abandoned", f"{scen.get('completed', 0)} / {scen.get('abandoned', 0)}"],
            [
                "… uploads on the wire: counted / refused late and recorded",
                f"{scen.get('on_wire', 0)}: {scen.get('counted', 0)} / {scen.get('refused', 0)}",
            ],
            ["… updates lost", scen.get("lost", 0)],
            ["device state-write kills", args.state_trials],
            ["… outcomes", ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))],
            ["corrupt or lost device states", failures],
            ["wall time", f"{wall:.0f} s (load average at the end {load}, on a shared 2-core machine)"],
        ],
    )
    body = (
        f"{summary}\n\n## Aggregator trials\n\n{table}\n\n"
        "`kill plan`: `point:n` kills the aggregator (SIGKILL from `IOFT_FAULT`) on the n-th pass "
        "through that point after a (re)start; `time:s` kills it from outside s seconds after the restarted "
        "aggregator saw its fleet online (when rounds start). Each kill is drawn among the rounds still to run. "
        "A planned kill that never landed (the run ended first) is not counted. `restored`: uploads the "
        "restarted aggregator read back from SQLite instead of waiting for devices to send them again.\n\n"
        "## Fleet fault scenarios\n\n"
        + markdown_table(
            [
                "scenario",
                "finished",
                "faults injected (each run)",
                "rounds completed",
                "abandoned",
                "uploads on the wire",
                "counted",
                "refused late",
                "lost",
                "median wall",
            ],
            scenario_table,
        )
        + "\n\n"
        + "".join(f"- did not finish: {e}\n" for e in scenario_errors)
        + "\nEach run: a fresh mosquitto, three `edge-trainer` daemons and `cloud-aggregator serve` "
        "(`checks/fault_scenarios.py`, the same functions the e2e tests assert on). An upload on the "
        "wire (one per device and round, seen by a subscriber to `#`) is *counted* when its round (or, "
        "late, the next) lists its device, *refused late* when the aggregator recorded why it could not use "
        "it (its round had closed, none was open, a duplicate), and *lost* otherwise. Uploads of abandoned "
        "rounds are on record with the round. `straggler (drop)` refuses the late upload as configured; "
        "`straggler (next_round)` counts it, damped, in the next round.\n\n"
        "## Device state writes\n\n`current`: the new file verified; `previous`: the kill fell between the "
        "two renames, the `.prev` copy verified; `mid-write`: the kill left a temp file behind (a write "
        "in progress); `corrupt`: no verified, consistent state — must be 0.\n"
    )
    print(body)
    if not args.no_write:
        write_result("reliability", body)
    ok = all(t.ok for t in trials) and failures == 0 and not scenario_errors and scen.get("lost", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

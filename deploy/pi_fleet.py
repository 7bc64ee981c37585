"""A fleet on the host with one device inside the arm64 root: ``fleet init`` (TLS, certificates),
the fleet's mosquitto, ``edge-trainer --simulate printer`` as ``pi1`` in the root (qemu) and as
``host1`` on the host (the x86_64 reference, same rounds), ``cloud-aggregator serve`` for a
few rounds of the README's PFL-DA task; CPU and RSS of both devices per round.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cloud_aggregator.local.broker import find_mosquitto, free_port
from cloud_aggregator.store.sqlite import SqliteStore
from deploy.pi_measure import Usage, Watched, host_env
from deploy.pi_root import ROOT_ENV, VENV, PiCheckError, in_root

FLEET = "pi-check"
PI, HOST = "pi1", "host1"
#: The daemon's "running" line, then one line per round and phase it answered.
MARK = re.compile(r" running \(state |: task \S+ round \d+ ")
ROUND = re.compile(r": task \S+ round (\d+) .*\((\d+\.\d+) s\)$")
TASKS = """
[collect]
deadline_s = {deadline}
min_participants = 2

[[task]]
name = "speed"
algorithm = "pflda"
model = "sigmoid_glm"
rounds = {rounds}
hparams = {{ lr = 0.1, weight_decay = 0.0003, local_steps = 10, lam = 0.9 }}
server = {{ weighting = "uniform" }}
"""


@dataclass
class DeviceFigures:
    """One device's figures over the fleet run."""

    cpu_per_round_s: list[float]  # CPU between the ends of successive rounds (round 1: since "running")
    train_s: list[float]  # the daemon's own per-round training time, from its log line
    start_cpu_s: float  # CPU until it logged "running" (imports, dataset, connect)
    start_wall_s: float
    usage: Usage

    @property
    def mean_cpu_s(self) -> float:
        """CPU per round over all rounds: finer than one round's difference (10 ms ticks)."""
        return sum(self.cpu_per_round_s) / max(1, len(self.cpu_per_round_s))

    @property
    def steady_cpu_s(self) -> float:
        """Median CPU per round from round 2 on (round 1 also holds the wait for the first announce)."""
        later = self.cpu_per_round_s[1:] or self.cpu_per_round_s
        return statistics.median(later)


@dataclass
class FleetRun:
    rounds: int
    completed: int
    participants: list[list[str]]
    round_wall_s: list[float]
    pi: DeviceFigures
    host: DeviceFigures


def host_script(name: str) -> str:
    """A console script of the host's venv (the one running this check)."""
    return str(Path(sys.executable).with_name(name))


def figures(device: Watched, usage: Usage) -> DeviceFigures:
    running = next((m for m in device.marks if "running (state" in m.line), None)
    if running is None:
        raise PiCheckError(f"fleet run: {device.argv[-1]} never logged 'running' (log: {device.log})")
    last_cpu: dict[int, float] = {}
    train: dict[int, float] = {}
    for m in device.marks:
        if (hit := ROUND.search(m.line)) is not None:
            last_cpu[int(hit[1])] = m.cpu_s
            train[int(hit[1])] = train.get(int(hit[1]), 0.0) + float(hit[2])
    ends = [last_cpu[r] for r in sorted(last_cpu)]
    per_round = [b - a for a, b in zip([running.cpu_s, *ends[:-1]], ends, strict=True)]
    return DeviceFigures(
        per_round, [train[r] for r in sorted(train)], running.cpu_s, running.at - device.started, usage
    )


def wait_for(what: str, ready, procs: list[Watched], timeout: float) -> None:
    """Poll ``ready()`` until true; fail with one line when time runs out or a process ends."""
    deadline = time.monotonic() + timeout
    while not ready():
        for p in procs:
            if not p.alive():
                raise PiCheckError(
                    f"fleet run: {' '.join(p.argv[-6:])} ended while waiting for {what} (log: {p.log})"
                )
        if time.monotonic() > deadline:
            raise PiCheckError(f"fleet run: no {what} after {timeout:.0f} s")
        time.sleep(0.5)


def run_fleet(root: Path, work: Path, rounds: int, log: Path) -> FleetRun:
    """The fleet run; every process is stopped on the way out."""
    base = work / "fleet"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    for d in (work, base):  # mosquitto drops to its own user: it must enter the fleet folder
        os.chmod(d, 0o755)
    port = free_port()
    fleet = base / "fleet"
    out = subprocess.run(
        [host_script("cloud-aggregator"), "fleet", "init", "--fleet", FLEET, "--devices", f"{PI},{HOST}",
         "--out", str(fleet), "--host", "127.0.0.1", "--port", str(port), "--bind", "127.0.0.1"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise PiCheckError(f"fleet init: {out.stderr.strip()[-200:]}")
    on_pi = root / "etc" / "ioft-pi-check" / PI
    shutil.rmtree(on_pi, ignore_errors=True)
    shutil.copytree(fleet / "devices" / PI, on_pi)  # the device folder, copied onto "the Pi"
    shutil.rmtree(root / "var" / "lib" / "ioft-pi-check", ignore_errors=True)
    env = host_env()
    procs: list[Watched] = []
    try:
        broker = Watched([find_mosquitto() or "mosquitto", "-c", str(fleet / "broker" / "mosquitto.conf")],
                         base / "mosquitto.log", env)  # fmt: skip
        procs.append(broker)
        wait_for("mosquitto listening", lambda: " running" in broker.tail(), procs, 20)
        pi = Watched(
            in_root(root, [f"{VENV}/bin/edge-trainer", "--device", PI, "--config",
                           f"/etc/ioft-pi-check/{PI}/device.toml", "--simulate", "printer",
                           "--state-dir", f"/var/lib/ioft-pi-check/{PI}"]),
            base / f"{PI}.log", {**ROOT_ENV, "PYTHONUNBUFFERED": "1"}, MARK,
        )  # fmt: skip
        host = Watched(
            [host_script("edge-trainer"), "--device", HOST, "--config", str(fleet / "devices" / HOST / "device.toml"),
             "--simulate", "printer", "--state-dir", str(base / f"{HOST}-state")],
            base / f"{HOST}.log", env, MARK,
        )  # fmt: skip
        procs += [pi, host]
        wait_for("'running' from both devices", lambda: all(d.marks for d in (pi, host)), procs, 600)
        agg_toml = fleet / "aggregator" / "aggregator.toml"
        with agg_toml.open("a") as f:
            f.write(TASKS.format(rounds=rounds, deadline=300))
        agg = Watched([host_script("cloud-aggregator"), "serve", "--config", str(agg_toml),
                       "--state-dir", str(base / "aggregator")], base / "aggregator.log", env)  # fmt: skip
        procs.append(agg)
        usage = agg.wait(600 * rounds)
        if usage is None or usage.returncode != 0:
            raise PiCheckError(
                f"fleet run: cloud-aggregator serve did not finish its {rounds} rounds (log: {agg.log})"
            )
        store = SqliteStore(base / "aggregator" / "aggregator.sqlite", readonly=True)
        try:
            records = store.rounds("speed")
        finally:
            store.close()
        pi_usage, host_usage = pi.stop(), host.stop()
        return FleetRun(
            rounds,
            sum(r.status == "completed" for r in records),
            [sorted(r.participants) for r in records],
            [r.finished - r.started for r in records],
            figures(pi, pi_usage),
            figures(host, host_usage),
        )
    finally:
        for p in reversed(procs):
            p.stop()
        with log.open("a") as out:
            out.write(f"\nfleet run logs in {base}\n")

"""The simulated fleet of ``benchmarks.fedbuff_vs_sync``: a clock of device speeds and churn, and the
synchronous and buffered runs over it (the real clients, admission, round engine and buffer).

See ``benchmarks.fedbuff_vs_sync`` for the conditions and what is measured.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cloud_aggregator.aggregation.fedbuff import Arrival, BufferConfig
from cloud_aggregator.local.demo import HPARAMS, LOSS_SCALE
from cloud_aggregator.rounds.buffered import BufferedServer
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet
from cloud_aggregator.rounds.types import RoundRecord
from trainer_lite.client import derive_rng, participate
from trainer_lite.data import Dataset
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

EXTRA = {"pflda": {"lam": 0.9}, "fedavg": {}}
#: FedBuff's reported speed-up over synchronous FL (Nguyen et al. 2022, abstract).
PAPER_SPEEDUP = 3.3


def fedbuff_label(k: int, server_lr: float) -> str:
    """A FedBuff setting's name in the tables and plots."""
    return f"FedBuff K={k}, η_g={server_lr:g}"


@dataclass(frozen=True)
class Conditions:
    """The fleet's speeds and churn, in units of ``t0`` (module docstring)."""

    devices: int = 40
    t0: float = 1.0
    slow_fraction: float = 0.1
    slow_factor: float = 10.0
    jitter: float = 0.1
    churn: float = 0.05
    away_mean: float = 10.0  # × t0

    @property
    def leave_rate(self) -> float:
        """Per unit time: P(leave within slow_factor × t0) = churn."""
        return -math.log1p(-self.churn) / (self.slow_factor * self.t0) if self.churn > 0 else 0.0

    def draw_slow(self, names: Sequence[str], seed: int) -> set[str]:
        """Which of ``names`` are the slow devices of fleet ``seed`` (the same draw in every run)."""
        n_slow = round(self.slow_fraction * len(names))
        picked = np.random.default_rng([seed, 14]).choice(len(names), size=n_slow, replace=False)
        return {names[i] for i in picked.tolist()}


class FleetClock:
    """Per-device speeds, update times and on/off sessions, drawn from one seed and shared by both runs."""

    def __init__(self, names: Sequence[str], cond: Conditions, seed: int) -> None:
        self.cond = cond
        slow = cond.draw_slow(names, seed)
        self.speed = {d: cond.slow_factor if d in slow else 1.0 for d in names}
        self.slow = {d for d, v in self.speed.items() if v > 1.0}
        self._work = {d: np.random.default_rng([seed, 14, i, 1]) for i, d in enumerate(names)}
        self._jobs = {d: 0 for d in names}
        self._session = {d: np.random.default_rng([seed, 14, i, 2]) for i, d in enumerate(names)}
        self._toggles: dict[str, list[float]] = {d: [] for d in names}

    def update_time(self, device: str) -> float:
        """The duration of ``device``'s next update (its k-th draw, the same in both runs)."""
        self._jobs[device] += 1
        jitter = float(np.exp(self.cond.jitter * self._work[device].standard_normal()))
        return self.cond.t0 * self.speed[device] * jitter

    def _extend(self, device: str, until: float) -> list[float]:
        toggles, rng, c = self._toggles[device], self._session[device], self.cond
        while c.churn > 0 and (not toggles or toggles[-1] <= until):
            online = len(toggles) % 2 == 0  # every device starts online; toggles alternate
            mean = 1.0 / c.leave_rate if online else c.away_mean * c.t0
            toggles.append((toggles[-1] if toggles else 0.0) + float(rng.exponential(mean)))
        return toggles

    def online(self, device: str, t: float) -> bool:
        toggles = self._extend(device, t)
        return sum(1 for x in toggles if x <= t) % 2 == 0

    def next_toggle(self, device: str, t: float) -> float:
        """The first time after ``t`` that ``device`` leaves or comes back (``inf`` without churn)."""
        for x in self._extend(device, t):
            if x > t:
                return x
        return math.inf


def printer_clients(n: int, seed: int) -> dict[str, ClientData]:
    """``n`` simulated printers of fleet ``seed`` (module docstring)."""
    from sensors.layers import to_xy
    from sensors.sim.printer import SPEED_SETTINGS, simulate_layers

    def xy(tables: list[np.ndarray]) -> Dataset:
        return Dataset(*to_xy(np.concatenate(tables)))

    out = {}
    for i in range(1, n + 1):
        name = f"printer{i}"
        runs = simulate_layers(name, seed=seed)
        rng = derive_rng(seed, name, "train-speeds")
        speeds = sorted(int(rng.choice(b)) for b in np.array_split(np.array(SPEED_SETTINGS), 3))
        out[name] = ClientData(
            xy([runs[s] for s in speeds]), xy([runs[s] for s in SPEED_SETTINGS if s not in speeds])
        )
    return out


def task_spec(algorithm: str, rounds: int, seed: int) -> TaskSpec:
    return TaskSpec(
        "speed",
        algorithm,
        "sigmoid_glm",
        hparams=HPARAMS | EXTRA[algorithm],
        server={"weighting": "uniform"},
        rounds=rounds,
        seed=seed,
    )


def fleet_loss(
    fleet: SimulatedFleet, global_params: Params, slow: set[str] = frozenset()
) -> tuple[float, float]:
    """Mean over every device of its model's test loss, PFL-DA Table 5 units; and over the ``slow`` ones."""
    per = {d: LOSS_SCALE * m["loss"] for d, m in fleet.evaluate(global_params).items()}
    slow_mean = float(np.mean([per[d] for d in slow])) if slow else math.nan
    return float(np.mean(list(per.values()))), slow_mean


@dataclass
class Curve:
    """Fleet loss against simulated time, and how much work got there."""

    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    #: Client updates started by each point (work done, kept or lost).
    work: list[int] = field(default_factory=list)
    #: The slow devices' mean loss at each point.
    slow: list[float] = field(default_factory=list)
    updates: int = 0  # client updates started in all

    def time_to(self, target: float) -> float:
        """First simulated time the fleet loss is at or below ``target`` (``inf``: never)."""
        return next((t for t, v in zip(self.times, self.losses, strict=True) if v <= target), math.inf)

    def held_from(self, target: float) -> float:
        """The time from which the fleet loss stays at or below ``target`` to the run's end (``inf``: it ends above)."""
        if not self.losses or self.losses[-1] > target:
            return math.inf
        above = [t for t, v in zip(self.times, self.losses, strict=True) if v > target]
        later = [t for t in self.times if not above or t > above[-1]]
        return later[0]

    def work_to(self, target: float) -> int | None:
        """Client updates started by the first point at or below ``target`` (``None``: never)."""
        return next((w for w, v in zip(self.work, self.losses, strict=True) if v <= target), None)


class ClockedFleet(SimulatedFleet):
    """A ``SimulatedFleet`` whose rounds take simulated time: :meth:`sample` decides who answers."""

    def __init__(self, spec: TaskSpec, clients: dict[str, ClientData], clock: FleetClock) -> None:
        super().__init__(spec, clients)
        self.clock = clock
        self.now = 0.0
        self.computed = 0

    def sample(self, round_: int) -> list[str]:
        """Run the round's clock from :attr:`now` to its close; the devices that answered it."""
        t0, clock, deadline = self.now, self.clock, self.now + 100 * self.clock.cond.slow_factor
        working: dict[str, float] = {}  # device -> when its upload lands
        away: dict[str, float] = {}  # device -> when it comes back
        answered: list[str] = []
        for d in sorted(self.clients):
            if clock.online(d, t0):
                working[d] = t0 + clock.update_time(d)
                self.computed += 1
            else:
                away[d] = clock.next_toggle(d, t0)
        t = t0
        while (working or not answered) and t < deadline:
            events = [(min(f, clock.next_toggle(d, t)), d, "work") for d, f in working.items()]
            events += [(back, d, "back") for d, back in away.items()]
            if not events:
                break
            t, d, kind = min(events)
            if kind == "back":  # the retained announcement: it trains this round too
                del away[d]
                working[d] = t + clock.update_time(d)
                self.computed += 1
            elif working[d] <= t:
                del working[d]
                answered.append(d)
            else:  # it left mid-update: no longer awaited; back later, maybe still in this round
                del working[d]
                away[d] = clock.next_toggle(d, t)
        self.now = t
        return sorted(answered)


def run_sync(spec: TaskSpec, clients: dict[str, ClientData], clock: FleetClock) -> Curve:
    """``spec.rounds`` synchronous rounds (``RoundEngine`` + ``fedavg``) on the clocked fleet."""
    fleet = ClockedFleet(spec, clients, clock)
    curve = Curve()
    engine: RoundEngine | None = None

    def on_record(rec: RoundRecord) -> None:
        loss, slow = fleet_loss(fleet, engine.global_params, clock.slow)
        curve.times.append(fleet.now)
        curve.losses.append(loss)
        curve.slow.append(slow)
        curve.work.append(fleet.computed)

    engine = RoundEngine(spec, fleet, on_record=on_record)
    engine.run()
    curve.updates = fleet.computed
    return curve


def run_fedbuff(
    spec: TaskSpec,
    clients: dict[str, ClientData],
    clock: FleetClock,
    config: BufferConfig,
    *,
    until: Callable[[float, float], bool],
) -> tuple[Curve, dict[str, int]]:
    """FedBuff on the same fleet: every online device trains continuously; stop when ``until(t, loss)``."""
    fleet = SimulatedFleet(spec, clients)  # the clients' data and local state (its rounds are unused)
    server = BufferedServer(spec, config, fleet=fleet.admission.fleet)
    curve = Curve()
    events: list[tuple[float, int, str, str, int]] = []  # (time, tie-break, kind, device, job round)
    seq = 0

    def push(t: float, kind: str, device: str, job_round: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, device, job_round))
        seq += 1

    def start(device: str, t: float) -> None:
        job = server.dispatch(device)
        push(t + clock.update_time(device), "done", device, job.round)
        curve.updates += 1

    for d in sorted(clients):
        start(d, 0.0)
        push(clock.next_toggle(d, 0.0), "toggle", d)
    while events:
        t, _, kind, d, job_round = heapq.heappop(events)
        if kind == "toggle":
            if clock.online(d, t):
                start(d, t)
            else:
                server.abandon(d)  # the update it was computing is lost
            push(clock.next_toggle(d, t), "toggle", d)
            continue
        job = server.jobs.get(d)
        if job is None or job.round != job_round:
            continue  # an update abandoned when the device left
        msg = fleet.train(d, job.params, job.round, server.phase, job.global_hash)
        verdict = server.receive(d, msg)
        if isinstance(verdict, Arrival) and verdict.applied:
            loss, slow = fleet_loss(fleet, server.global_params, clock.slow)
            curve.times.append(t)
            curve.losses.append(loss)
            curve.slow.append(slow)
            curve.work.append(curve.updates)
            if until(t, loss):
                break
        start(d, t)
    return curve, dict(server.ledger())


def calibrate_t0(clients: dict[str, ClientData], algorithm: str, repeats: int = 30) -> float:
    """Wall time (s) of one ``participate()`` call (the task's local steps) on this machine: the
    fastest of ``repeats``, the machine's own compute time without the other processes that share
    its cores (their load inflates the median several-fold on a busy two-core host)."""
    spec = task_spec(algorithm, 1, 0)
    fleet = SimulatedFleet(spec, clients)
    server = BufferedServer(spec)
    device = sorted(clients)[0]
    data, local, took = fleet.clients[device], fleet.local[device], []
    for r in range(1, repeats + 1):
        began = time.perf_counter()
        _, local = participate(
            fleet.algo,
            device,
            server.global_params,
            local,
            data.train,
            data.test,
            round_=r,
            phase=server.phase,
        )
        took.append(time.perf_counter() - began)
    return min(took)

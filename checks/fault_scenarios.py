"""Fleet faults against real processes, one function per scenario, shared by the e2e tests
(which assert on what a run returns) and ``benchmarks.reliability`` (which counts it).

Each scenario takes a :class:`~cloud_aggregator.local.fleet.LocalFleet` on a fresh mosquitto, runs
three ``edge-trainer`` daemons and ``cloud-aggregator serve``, injects its faults and
returns a :class:`ScenarioRun`: the round records, every upload seen on the wire, and
the accounting of those uploads against what the aggregator recorded.

Steps are sequenced by events, never by sleeps: the aggregator freezes itself at a named
point (``IOFT_FAULT=<point>:<n>:stop``), the scenario acts on the fleet, then sends SIGCONT.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cloud_aggregator.local.broker import BrokerProcess, start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet, Sniffer, aggregator_toml, pflda_task
from cloud_aggregator.rounds.types import Reason
from cloud_aggregator.store.sqlite import SqliteStore
from edge.task_state import load_task_state
from ioft_protocol import round_messages, topics

DEVICES = ("printer1", "printer2", "printer3")
P1, P2, P3 = DEVICES
TASK = "speed"
#: Refusal codes that account for a genuine upload the aggregator could not use: it came
#: for a round already closed (or while none was open), or repeated one already counted.
LATE_CODES = (Reason.STALE_ROUND, Reason.NO_ROUND, Reason.REPLAY)


# -- process and wire helpers ------------------------------------------------------------------------
def proc_state(pid: int) -> str:
    """The kernel's one-letter state of a process (``T``: stopped), ``""`` once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text.rsplit(")", 1)[1].split()[0]


def wait_stopped(proc: subprocess.Popen, timeout: float, what: str, log: Path | None = None) -> None:
    """Block until ``proc`` froze itself (an ``IOFT_FAULT`` ``stop`` action)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_state(proc.pid) == "T":
            return
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise AssertionError(f"process never stopped at {what} (rc {proc.poll()}):\n{tail}")


def freeze(proc) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while proc_state(proc.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)


def thaw(proc) -> None:
    os.kill(proc.pid, signal.SIGCONT)


def kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def uploads(sniffer: Sniffer, task: str, device: str) -> dict[int, round_messages.UpdateMessage]:
    """Every upload ``device`` sent for ``task``, by round (a re-send replaces an identical copy)."""
    topic = topics.topic_up(FLEET, task, device)
    out = {}
    for t, payload in list(sniffer.messages):
        if t == topic:
            msg = round_messages.UpdateMessage.decode(payload)
            out[msg.round] = msg
    return out


def await_exit(fleet: LocalFleet, timeout: float = 120) -> None:
    rc = fleet.wait_aggregator(timeout)
    if rc != 0:
        raise AssertionError(f"aggregator exited with {rc}:\n{fleet.log('aggregator')[-3000:]}")


def add_collect(toml: str, **items: object) -> str:
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in items.items())
    return toml.replace("[collect]\n", "[collect]\n" + lines)


def global_of(fleet: LocalFleet, digest: str):
    store = SqliteStore(fleet.db, readonly=True)
    try:
        return store.get_params(digest)
    finally:
        store.close()


# -- what a run returns ----------------------------------------------------------------------------
@dataclass
class ScenarioRun:
    """A scenario's outcome: round records, the uploads on the wire, and their accounting.

    Every upload seen on the wire (one per device and round; a re-send after a reconnect
    is the same upload) is *counted* (a participant of its round, or of the next as a
    late update), *refused* (the aggregator recorded why: its round had closed, no round
    was open, a duplicate), or *lost*: on the wire and nowhere in the aggregator's
    records. ``lost`` must be 0.
    """

    name: str
    faults: list[str]
    records: list
    sent: dict[str, dict[int, round_messages.UpdateMessage]]
    refused: dict[str, int]
    extras: dict = field(default_factory=dict)
    wall_s: float = 0.0

    def _unaccounted(self) -> dict[str, int]:
        by_round = {r.round: r for r in self.records}
        out: dict[str, int] = {}
        for device, rounds in self.sent.items():
            for r in rounds:
                own = by_round.get(r)
                nxt = by_round.get(r + 1)
                if own is not None and device in own.participants:
                    continue
                if nxt is not None and device in (nxt.extra or {}).get("late", []):
                    continue
                out[device] = out.get(device, 0) + 1
        return out

    @property
    def on_wire(self) -> int:
        return sum(len(r) for r in self.sent.values())

    @property
    def counted(self) -> int:
        return self.on_wire - sum(self._unaccounted().values())

    @property
    def late_counted(self) -> int:
        return sum(len((r.extra or {}).get("late", [])) for r in self.records)

    @property
    def refused_late(self) -> int:
        """Uploads not counted and accounted for by a recorded refusal (at most one each)."""
        return sum(min(n, self.refused.get(d, 0)) for d, n in self._unaccounted().items())

    @property
    def lost(self) -> int:
        return sum(max(0, n - self.refused.get(d, 0)) for d, n in self._unaccounted().items())

    def statuses(self) -> Counter:
        return Counter(r.status for r in self.records)


def _finish(name: str, fleet: LocalFleet, sniffer: Sniffer, faults_: list[str], started: float, **extras):
    await_exit(fleet)
    store = SqliteStore(fleet.db, readonly=True)
    try:
        by_reason = store.rejection_counts_by_reason()  # no_round refusals name no task
    finally:
        store.close()
    refused = {d: sum(per.get(code, 0) for code in LATE_CODES) for d, per in by_reason.items()}
    return ScenarioRun(
        name,
        faults_,
        fleet.rounds(TASK),
        {d: uploads(sniffer, TASK, d) for d in DEVICES},
        refused,
        extras,
        time.monotonic() - started,
    )


@contextlib.contextmanager
def _running(
    fleet: LocalFleet, fault: str, task: dict, *, straggler: str | None = None, **collect
) -> Iterator[tuple[subprocess.Popen, Sniffer]]:
    """A sniffer on ``#``, the three devices, and the aggregator with ``IOFT_FAULT=fault``."""
    sniffer = Sniffer(fleet.broker_url)  # paho reconnects it if the broker restarts
    try:
        for d in DEVICES:
            fleet.start_device(d)
        toml = aggregator_toml(fleet.broker_url, fleet.work / "aggregator", [task], **collect)
        if straggler is not None:
            toml = add_collect(toml, straggler=straggler)
        yield fleet.start_aggregator(toml, fault=fault), sniffer
    finally:
        sniffer.stop()


# -- the scenarios ---------------------------------------------------------------------------------
def device_killed(fleet: LocalFleet, seed: int = 0) -> ScenarioRun:
    """printer3 SIGKILLed between rounds 2 and 3: rounds 3–5 close at their deadline without it."""
    started = time.monotonic()
    with _running(
        fleet,
        "after_save:2:stop",  # frozen between rounds 2 and 3
        pflda_task(TASK, seed, 5),
        expected=list(DEVICES),
        deadline_s=2.0,
        min_participants=2,
        max_extensions=5,  # a slow survivor under load extends a round instead of abandoning it
        startup_wait_s=60,
    ) as (agg, sniffer):
        wait_stopped(agg, 120, "after round 2", fleet.work / "aggregator.log")
        kill(fleet.devices[P3])
        thaw(agg)
        return _finish("device killed mid-run", fleet, sniffer, [f"SIGKILL {P3}"], started)


def broker_restart(fleet: LocalFleet, broker: BrokerProcess, seed: int = 0) -> ScenarioRun:
    """mosquitto SIGKILLed (no persistence) right after round 4 was announced, then restarted."""
    started = time.monotonic()
    with _running(
        fleet,
        "after_announce:4:stop",  # round 4 announced, nothing collected
        pflda_task(TASK, seed, 8),
        expected=list(DEVICES),
        deadline_s=60,
        startup_wait_s=60,
    ) as (agg, sniffer):
        wait_stopped(agg, 120, "round 4 announced", fleet.work / "aggregator.log")
        sniffer.subscribed.clear()
        broker.kill()  # the retained round-4 announcement dies with it
        killed_at = time.time()
        restarted = start_mosquitto(broker.port, log_file=fleet.work / "mosquitto-restarted.log")
        try:
            # The sniffer back on '#' before the rounds go on: the fleet's sessions reconnect within
            # a drawn 0.5 s, paho's sniffer after 1 s, and it would miss what they send meanwhile.
            if not sniffer.subscribed.wait(60):
                raise RuntimeError("the sniffer did not subscribe again within 60 s of the broker's restart")
            thaw(agg)
            run = _finish("broker restarted mid-round", fleet, sniffer, ["SIGKILL mosquitto"], started)
            run.extras = {
                "killed_at": killed_at,
                "devices_alive": all(p.poll() is None for p in fleet.devices.values()),
            }
            return run
        finally:
            restarted.stop()


def straggler(fleet: LocalFleet, mode: str, seed: int = 5) -> ScenarioRun:
    """printer3 frozen past round 2's deadline, answers round 2 between rounds, then dies."""
    started = time.monotonic()
    task = pflda_task(TASK, seed, 3)
    with _running(
        fleet,
        "after_save:1:stop,after_save:2:stop",
        task,
        straggler=mode,
        expected=list(DEVICES),
        deadline_s=4.0,
        min_participants=2,
        max_extensions=5,
        startup_wait_s=60,
    ) as (agg, sniffer):
        log = fleet.work / "aggregator.log"
        wait_stopped(agg, 120, "after round 1", log)
        freeze(fleet.devices[P3])  # misses round 2's deadline
        thaw(agg)
        wait_stopped(agg, 120, "after round 2", log)
        thaw(fleet.devices[P3])  # answers round 2 now, while the aggregator is between rounds
        wait_until(lambda: 2 in uploads(sniffer, TASK, P3), 60, "printer3's late round-2 upload")
        kill(fleet.devices[P3])  # and is gone before round 3: no fresh upload replaces it
        thaw(agg)
        faults_ = [f"SIGSTOP {P3} past the deadline", f"SIGKILL {P3}"]
        return _finish(f"straggler ({mode})", fleet, sniffer, faults_, started, task=task)


def offline_rejoin(fleet: LocalFleet, seed: int = 6) -> ScenarioRun:
    """printer3 SIGKILLed after round 2, restarted after round 5: it rejoins from its saved state."""
    started = time.monotonic()
    task = pflda_task(TASK, seed, 7)
    with _running(
        fleet,
        "after_save:2:stop,after_save:5:stop",
        task,
        expected=list(DEVICES),
        deadline_s=3.0,
        min_participants=2,
        max_extensions=5,
        startup_wait_s=60,
    ) as (agg, sniffer):
        log = fleet.work / "aggregator.log"
        wait_stopped(agg, 120, "after round 2", log)
        # Its round-2 upload on the wire: its state on disk is the one after round 2 (saved before sent).
        wait_until(lambda: 2 in uploads(sniffer, TASK, P3), 120, "printer3's round-2 upload")
        kill(fleet.devices[P3])
        saved = load_task_state(fleet.work / P3 / "tasks" / TASK / "local.safetensors")
        thaw(agg)
        wait_stopped(agg, 120, "after round 5", log)
        fleet.start_device(P3)
        # Its answer to the retained round 5, not merely "online": thawed before that answer, the
        # aggregator's round 6 replaces the retained round 5 and the device never sees round 5.
        wait_until(lambda: 5 in uploads(sniffer, TASK, P3), 120, "printer3's answer to the retained round 5")
        thaw(agg)
        faults_ = [f"SIGKILL {P3}", f"restart {P3}"]
        return _finish(
            "device offline for 3 rounds", fleet, sniffer, faults_, started, task=task, saved=saved
        )


def thin_round(fleet: LocalFleet, seed: int = 8) -> ScenarioRun:
    """min_participants 3 of 3: round 2 is extended until a frozen printer3 answers; after it
    dies, rounds 3 and 4 wait out their extensions and are abandoned."""
    started = time.monotonic()
    with _running(
        fleet,
        "after_save:1:stop,after_save:2:stop",
        pflda_task(TASK, seed, 4),
        expected=None,  # whoever is online
        deadline_s=1.5,
        min_participants=3,
        max_extensions=3,
        startup_wait_s=60,
    ) as (agg, sniffer):
        log = fleet.work / "aggregator.log"
        wait_stopped(agg, 120, "after round 1", log)
        freeze(fleet.devices[P3])  # still online (no will yet), but silent
        thaw(agg)
        wait_until(
            lambda: (
                f"task {TASK} round 2: 2 valid uploads < min_participants 3; extending the deadline (1/3)"
                in fleet.log("aggregator")
            ),
            60,
            "round 2's first extension",
        )
        thaw(fleet.devices[P3])  # answers within the extension
        wait_stopped(agg, 120, "after round 2", log)
        kill(fleet.devices[P3])  # its will marks it offline: rounds 3 and 4 have two devices
        thaw(agg)
        faults_ = [f"SIGSTOP {P3} into an extension", f"SIGKILL {P3}"]
        return _finish("thin rounds (min 3 of 3)", fleet, sniffer, faults_, started)


#: name -> runner(fleet, broker): every scenario the reliability study repeats.
SCENARIOS: dict[str, Callable[[LocalFleet, BrokerProcess], ScenarioRun]] = {
    "device_killed": lambda fleet, broker: device_killed(fleet),
    "broker_restart": broker_restart,
    "straggler_drop": lambda fleet, broker: straggler(fleet, "drop"),
    "straggler_next_round": lambda fleet, broker: straggler(fleet, "next_round"),
    "offline_rejoin": lambda fleet, broker: offline_rejoin(fleet),
    "thin_round": lambda fleet, broker: thin_round(fleet),
}

"""``cloud-aggregator demo`` (``make demo``): a whole fleet on one machine.

A broker (mosquitto if installed, else amqtt), ``cloud-aggregator serve`` and N
``edge-trainer --device printerK --simulate printer`` processes, all on loopback,
started and stopped by :class:`cloud_aggregator.local.fleet.LocalFleet`.
The fleet trains PFL-DA with the sigmoid GLM of PFL-DA Table 4 on simulated
printers (each has run only a few speed settings; the test split is the speeds it
never ran), then the same devices train alone ("indiv"), and the demo prints both.
Each printer also serves as one answering its layers does (``[serve] hold_out_always``: its
newest rows held out of training judge its candidates each round) and reports what it serves
in its round report (``served_test_loss``, ``serves_<candidate>``): the tables print it too.

Then a new printer joins the trained fleet: its ``edge-trainer`` starts, and the
aggregator is restarted with PFL-DA's ``rounds`` raised by ``newcomer_rounds`` (the
store resumes the task where it stopped) and an indiv task for the newcomer alone.
The newcomer's personal model is cold-started on the device from the fleet's shared
decoder at its first round (``trainer_lite.client.participate``); the closing table
gives its loss and what it serves 1, 5 and ``newcomer_rounds`` rounds after joining, beside indiv's.

Meanwhile two simulated welders work on the device side (``demo_welders``): one's tool starts to
wear, and the demo ends with the weld at which its alert was raised beside the weld at which the
lagging maintenance log first confirmed the wear (the other welder: no alert).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cloud_aggregator.console import cli as fleet_console
from cloud_aggregator.local.broker import interrupt_on_sigterm
from cloud_aggregator.local.demo_advice import print_advice
from cloud_aggregator.local.demo_welders import print_welders, start_welders
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml
from cloud_aggregator.rounds.types import RoundRecord
from cloud_aggregator.store.sqlite import SqliteStore

#: Per-device test loss in the units of PFL-DA Table 5: 50 · MSE(s / 50).
LOSS_SCALE = 50.0
#: Adam without weight decay: with only 4 parameters and small late gradients, Adam's L2 term
#: (added before normalisation) dominates the step and leaves PFL-DA oscillating round to round.
#: 30 inner steps and a decaying lr let the shared decoder settle in 200 rounds (in-process
#: sweep over fleet seeds 0-2: the fleet mean of PFL-DA is below indiv's on each).
HPARAMS = {"lr": 0.1, "weight_decay": 0.0, "local_steps": 30, "lr_decay": 0.95, "lr_decay_every": 5}
#: (task name, algorithm, extra hyperparameters): PFL-DA, then the two references.
TASKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("speed-pflda", "pflda", {"lam": 0.9}),
    ("speed-indiv", "indiv", {}),
    ("speed-fedavg", "fedavg", {}),
)


def _task(name: str, algorithm: str, rounds: int, hparams: dict, **more: object) -> dict[str, object]:
    """One of the demo's tasks: the sigmoid GLM, seed 0, uniform weighting; ``more``: its other keys."""
    return {"name": name, "algorithm": algorithm, "model": "sigmoid_glm", "rounds": rounds, "seed": 0,
            "hparams": hparams, "server": {"weighting": "uniform"}, **more}  # fmt: skip


def _demo_toml(
    fleet: str,
    broker: str,
    state_dir: Path,
    tasks: list,
    expected: list[str],
    min_participants: int,
    **more: object,
) -> str:
    """The aggregator's TOML for ``tasks``: a 20 s deadline, extended at most twice; ``more``: other settings."""
    return aggregator_toml(broker, state_dir, tasks, fleet=fleet, deadline_s=20, min_participants=min_participants,
                           expected=expected, max_extensions=2, startup_wait_s=60, **more)  # fmt: skip


def demo_config(fleet: str, broker: str, state_dir: Path, devices: list[str], rounds: int) -> str:
    """The aggregator's TOML: PFL-DA first, then the same model trained alone, then one global model."""
    tasks = [_task(name, algorithm, rounds, HPARAMS | extra) for name, algorithm, extra in TASKS]
    return _demo_toml(
        fleet, broker, state_dir, tasks, devices, max(1, len(devices) // 2), settings={"restart": True}
    )


#: Rounds the fleet runs after the new printer joins, and those its closing table shows.
NEWCOMER_ROUNDS = 20
NEWCOMER_SHOWN = (1, 5, 20)


def newcomer_config(
    fleet: str, broker: str, state_dir: Path, devices: list[str], newcomer: str, rounds: int, more: int
) -> str:
    """PFL-DA continued for ``more`` rounds with every printer, then ``newcomer`` alone (indiv)."""
    tasks = [
        _task("speed-pflda", "pflda", rounds + more, HPARAMS | dict(TASKS[0][2])),
        _task("speed-newcomer-indiv", "indiv", more, HPARAMS, devices={"ids": [newcomer]}),
    ]
    return _demo_toml(fleet, broker, state_dir, tasks, [*devices, newcomer], 1)


#: The round report's metrics of what a device serves (``edge.serving.offers.Offers.served_metrics``).
SERVED_LOSS, SERVES, SERVED_ROUND = "served_test_loss", "serves_", "served_round"


def served(metrics: dict[str, float], round_: int) -> tuple[float, str] | None:
    """``(the served model's test loss, its candidate)`` in one device's report of round ``round_``;
    the candidate reads ``name@k`` where the model serving is round k's, an earlier one the gate
    kept.  ``None`` where it served nothing yet."""
    if SERVED_LOSS not in metrics:
        return None
    names = [k.removeprefix(SERVES) for k, v in metrics.items() if k.startswith(SERVES) and v == 1.0]
    name = names[0] if names else "?"
    kept = int(metrics.get(SERVED_ROUND, round_))
    return LOSS_SCALE * metrics[SERVED_LOSS], name if kept == round_ else f"{name}@{kept}"


def _cell(got: tuple[float, str] | None) -> str:
    """A served loss with its candidate, e.g. ``0.2177 alone``."""
    return f"{got[0]:>8.4f} {got[1]:<12}" if got is not None else f"{'-':>8} {'':<12}"


def _newcomer_losses(
    store: SqliteStore, task: str, device: str, after: int
) -> dict[int, tuple[float, tuple[float, str] | None]]:
    """``{rounds since joining: (device's test loss, what it served)}`` of ``task``'s rounds after ``after``."""
    return {
        rec.round - after: (
            LOSS_SCALE * rec.metrics[device]["test_loss"],
            served(rec.metrics[device], rec.round),
        )
        for rec in store.rounds(task)
        if rec.round > after and "test_loss" in rec.metrics.get(device, {})
    }


def run_newcomer(fleet: LocalFleet, devices: list[str], rounds: int, more: int) -> int:
    """A new printer joins after round ``rounds``; print its loss beside indiv's. Returns an exit code."""
    newcomer = f"printer{len(devices) + 1}"
    print(f"\n{newcomer} joins the trained fleet; PFL-DA goes on for {more} rounds with it:")
    fleet.start_device(newcomer, *_serving(fleet.work, newcomer), simulate="printer")
    toml = newcomer_config(
        fleet.fleet, fleet.broker_url, fleet.work / "aggregator", devices, newcomer, rounds, more
    )
    agg = fleet.start_aggregator(toml, name="aggregator-newcomer")
    rc = _follow(agg, fleet.db, [*devices, newcomer], rounds + more, timeout=600, after=rounds)
    if rc != 0:
        return _aggregator_failed(fleet, "aggregator-newcomer", rc)
    store = SqliteStore(fleet.db)
    pflda = _newcomer_losses(store, "speed-pflda", newcomer, rounds)
    indiv = _newcomer_losses(store, "speed-newcomer-indiv", newcomer, 0)
    store.close()
    print(
        f"\n{newcomer}'s test loss after joining (PFL-DA: its personal model, cold-started from the fleet's "
        "decoder; served: what it answers with, the best of its candidates on its newest rows, name@k where the gate "
        "kept round k's; indiv: alone):"
    )
    print(
        f"{'rounds since joining':>21} {'PFL-DA':>8} {'served':>8} {'':<12} {'indiv':>8} {'served vs indiv':>16}"
    )
    nothing = (float("nan"), None)
    for r in (k for k in NEWCOMER_SHOWN if k <= more):
        (p, got), i = pflda.get(r, nothing), indiv.get(r, nothing)[0]
        print(f"{r:>21} {p:>8.4f} {_cell(got)} {i:>8.4f} {_versus(got, i)}")
    return 0


def _versus(got: tuple[float, str] | None, indiv: float) -> str:
    return f"{100 * (got[0] - indiv) / indiv:>+15.1f}%" if got is not None else f"{'-':>16}"


#: The live table shows every this-many-th round (and the first and the last).
SHOW_EVERY = 10


def _table(records: list[RoundRecord], devices: list[str]) -> list[str]:
    head = f"{'round':>5} {'took part':>9} " + " ".join(f"{d:>9}" for d in devices) + f" {'fleet mean':>10}"
    lines = [head, "-" * len(head)]
    for rec in records:
        lines.append(_row(rec, devices))
    return lines


def _row(rec: RoundRecord, devices: list[str]) -> str:
    cells = []
    for d in devices:
        m = rec.metrics.get(d, {}).get("test_loss")
        cells.append(f"{LOSS_SCALE * m:>9.4f}" if m is not None else f"{'-':>9}")
    mean = rec.mean_metric("test_loss")
    mean_s = f"{LOSS_SCALE * mean:>10.4f}" if mean is not None else f"{'-':>10}"
    return f"{rec.round:>5} {len(rec.participants):>9} " + " ".join(cells) + f" {mean_s}"


def _final(store: SqliteStore, task: str) -> dict[str, tuple[float, tuple[float, str] | None]]:
    """Each device's test loss at its last answered round of ``task``, and what it served then."""
    out: dict[str, tuple[float, tuple[float, str] | None]] = {}
    for rec in store.rounds(task):
        for d, m in rec.metrics.items():
            if "test_loss" in m:
                out[d] = (LOSS_SCALE * m["test_loss"], served(m, rec.round))
    return out


def run_demo(
    *,
    devices: int = 4,
    rounds: int = 200,
    broker: str | None = None,
    workdir: Path | None = None,
    prefer: str = "mosquitto",
    console: bool = False,
    newcomer_rounds: int = NEWCOMER_ROUNDS,
) -> int:
    """Run the demo; with ``console`` the live fleet console is up from the start and stays up
    after the final table (with the devices and the broker) until Ctrl-C."""
    if devices < 2:
        print("the demo needs at least 2 devices", file=sys.stderr)
        return 2
    started = time.monotonic()
    interrupt_on_sigterm()  # so `finally` stops the broker and the device processes
    own_dir = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="ioft-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    names = [f"printer{i}" for i in range(1, devices + 1)]
    fleet: LocalFleet | None = None
    view: subprocess.Popen | None = None
    welders: subprocess.Popen | None = None
    try:
        fleet = LocalFleet.start(work, broker=broker, prefer=prefer, fleet="demo")
        agg, view = _start_training(fleet, work, names, rounds, console, broker)
        rc = _follow(agg, fleet.db, names, rounds, timeout=600)
        if rc != 0:
            return _aggregator_failed(fleet, "aggregator", rc)
        _print_results(fleet.db, names)
        print_advice(work, names)  # cloud_aggregator/demo_advice.py: a second table, each printer's advice
        welders = start_welders(work)  # demo_welders.py: in the background while the newcomer trains
        if newcomer_rounds > 0 and run_newcomer(fleet, names, rounds, newcomer_rounds) != 0:
            return 1
        print_welders(welders)
        print(f"\ndemo finished in {time.monotonic() - started:.1f} s")
        _linger(view)
        return 0
    finally:
        _stop_side_processes(welders, view)
        if fleet is not None:
            fleet.stop()  # the aggregator first, then the devices it talks to, then the broker
        if own_dir and os.environ.get("IOFT_KEEP_DEMO") != "1":
            shutil.rmtree(work, ignore_errors=True)


def _start_training(
    fleet: LocalFleet, work: Path, names: list[str], rounds: int, console: bool, broker: str | None
) -> tuple[subprocess.Popen, subprocess.Popen | None]:
    """Start the devices, the aggregator and (with ``console``) the console; say where things are."""
    print(f"broker: {fleet.broker.kind} on {fleet.broker_url}" if fleet.broker is not None
          else f"broker: {broker} (external)")  # fmt: skip
    for name in names:
        fleet.start_device(name, *_serving(work, name), simulate="printer")
    agg = fleet.start_aggregator(
        demo_config(fleet.fleet, fleet.broker_url, work / "aggregator", names, rounds)
    )
    print(f"{len(names)} edge-trainer processes and the aggregator started; state and logs in {work}")
    view = _start_console(work) if console else None
    print("test loss = 50·MSE(speed/50) on each printer's unseen speeds (PFL-DA Table 5 units)\n")
    return agg, view


def _serving(work: Path, device: str) -> list[str]:
    """``--config`` for a demo printer: it judges its candidates on its newest rows (held out of
    training) from the first round and reports what it serves, as a printer answering its layers
    does, on the seeded rows only (``[serve] hold_out_always``: no live rows, so the tables compare
    the same rows)."""
    path = work / f"{device}.toml"
    path.write_text("[serve]\nhold_out_always = true\n")
    return ["--config", str(path)]


def _print_results(db: Path, names: list[str]) -> None:
    """indiv's rounds, then each printer's final test loss under PFL-DA, indiv and FedAvg."""
    store = SqliteStore(db)
    indiv_rounds = store.rounds("speed-indiv")
    final = {name: _final(store, name) for name, _, _ in TASKS}
    store.close()
    print(f"\nEach printer alone (indiv: same model and rounds, nothing shared), every {SHOW_EVERY}th round:")
    print("\n".join(_table(indiv_rounds[SHOW_EVERY - 1 :: SHOW_EVERY], names)))
    pflda, indiv, fedavg = ({d: v[0] for d, v in final[name].items()} for name, _, _ in TASKS)
    answers = {d: v[1] for d, v in final[TASKS[0][0]].items()}
    print("\nFinal test loss per printer (lower is better; PFL-DA: its personal model; served: what the printer "
          "answers with, the best of its candidates (PFL-DA's personal or global model, or its own model "
          "trained alone) on its newest rows, name@k where the gate kept round k's; FedAvg: one global model "
          "for all printers):")  # fmt: skip
    print(f"{'printer':>10} {'PFL-DA':>8} {'served':>8} {'':<12} {'indiv':>8} {'FedAvg':>8} "
          f"{'PFL-DA vs indiv':>16} {'served vs indiv':>16}")  # fmt: skip
    for d in names:
        p, i, f = (t.get(d, float("nan")) for t in (pflda, indiv, fedavg))
        got = answers.get(d)
        print(
            f"{d:>10} {p:>8.4f} {_cell(got)} {i:>8.4f} {f:>8.4f} {100 * (p - i) / i:>+15.1f}% {_versus(got, i)}"
        )
    mp, mi, mf = (sum(t.values()) / max(1, len(t)) for t in (pflda, indiv, fedavg))
    ms = [v[0] for v in answers.values() if v is not None]
    mean_served = (sum(ms) / len(ms), "") if ms and len(ms) == len(answers) else None
    print(f"{'fleet mean':>10} {mp:>8.4f} {_cell(mean_served)} {mi:>8.4f} {mf:>8.4f} "
          f"{100 * (mp - mi) / mi:>+15.1f}% {_versus(mean_served, mi)}")  # fmt: skip


def _aggregator_failed(fleet: LocalFleet, name: str, rc: int) -> int:
    """Say the aggregator ``name`` exited with ``rc``, with its log's tail; the demo's exit code."""
    print(f"\naggregator exited with {rc}; its log:\n" + fleet.log(name)[-3000:], file=sys.stderr)
    return 1


def _linger(view: subprocess.Popen | None) -> None:
    """With the console up: keep it (and the devices and the broker) until Ctrl-C."""
    if view is not None and view.poll() is None:
        print("the fleet console stays up (with the devices and the broker); Ctrl-C stops them", flush=True)
        view.wait()


def _stop_side_processes(welders: subprocess.Popen | None, view: subprocess.Popen | None) -> None:
    """Stop the simulated welders and the console, where they still run."""
    if welders is not None and welders.poll() is None:
        welders.kill()
        welders.communicate()
    if view is not None and view.poll() is None:
        view.terminate()
        view.wait(10)


def _start_console(work: Path) -> subprocess.Popen | None:
    """``cloud-aggregator console`` on the demo's aggregator (its usual port, else any free one)."""
    for port in (fleet_console.DEFAULT_PORT, 0):
        try:
            proc, url = fleet_console.launch(work / "aggregator.toml", work / "console.log", port=port)
        except fleet_console.ConsoleStartError as exc:
            print(f"{exc}", file=sys.stderr)
            continue
        # The landing page is the machines view; the rounds and curves are one click away.
        print(f"fleet console: {url} (the machines; learning view: {url}learning)", flush=True)
        return proc
    return None


def _follow(
    agg: subprocess.Popen, db: Path, devices: list[str], rounds: int, timeout: float, after: int = 0
) -> int:
    """Print PFL-DA's rounds after round ``after`` as the aggregator records them: the first, every
    ``SHOW_EVERY``-th and the last (a summary a reader takes in, not one row a round); return the
    aggregator's exit code."""
    deadline = time.monotonic() + timeout
    shown = after
    printed_head = False
    while True:
        done = agg.poll() is not None
        if db.exists():
            store = SqliteStore(db, readonly=True)
            records = store.rounds("speed-pflda")
            store.close()
            if records and not printed_head:
                print("PFL-DA (sigmoid GLM; only the shared decoder w travels):")
                print("\n".join(_table([], devices)))
                printed_head = True
            for rec in records[shown:]:
                if rec.round in (after + 1, rounds) or rec.round % SHOW_EVERY == 0:
                    print(_row(rec, devices), flush=True)
            shown = len(records)
        if done:
            return agg.returncode
        if time.monotonic() > deadline:
            agg.kill()
            return -1
        time.sleep(0.25)

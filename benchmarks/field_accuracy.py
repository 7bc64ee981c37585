"""Field accuracy of the serving personalized model against the same machine's model trained alone and
the global model, round by round, on a simulated fleet of printers and welders; and the welds from a
tool starting to wear to the alert.

In process (``cloud_aggregator.rounds.simulation``: the clients run the ``trainer_lite`` code the
devices run, the server the aggregator's round engine).  Per machine kind three fleets train
the same model on the same rows: **personalized** (the algorithm a fleet serves with: PFL-DA
for printers, FedRep for welders; each machine answers with its global shared parts and its
own local parts), **alone** (``indiv``: each machine trains by itself) and **global**
(FedAvg: every machine answers with the one global model).

Field rows are rows the machines meet after training, answered by each round's serving model and
scored when their truth lands (the score is credited to the round whose model answered, so
the lag only delays it): a printer's layers at the speeds it did not train on (truth: the
commanded speed, known with the layer; field **error**, mean |expected - commanded| mm/s, lower
is better), a welder's next welds of each tool class (truth: the maintenance log, hours late;
field **accuracy**).

Each round's serving model is the one ``edge-trainer`` swaps in after the round
(``Server.offer``): the global the device trained from (its downlink) with the device's own
parts after the round, for every arm alike -- not the global aggregated at the end of that round,
which no device holds until the next round's downlink (and which a FedRep head, fitted on the
old body, was never fitted to).

Time to alert: after the last round each welder's serving model answers a stream of welds from
``edge.recording.simulate``'s wearing-tool rule (new tool TC1 for ``PRE`` welds, then each weld
worn, TC4, with a probability rising linearly to 1 over ``WEAR_WELDS`` welds) and the device's
alert rule (:mod:`edge.serving.alerts`, P(TC4) > 0.8 in 4 of the last 5 welds) raises; we count
welds from the first wearing weld to the raise, and raises before it (false alerts).

Interval coverage (:mod:`edge.serving.conformal`): after the last round each machine's serving
model answers a stream of labelled rows (a printer: its field layers; a welder: ``COVER_WELDS``
new welds of random tool classes), each answer carrying its split-conformal interval or set at
``[serve] coverage``'s 0.9, the calibration fed by every label as it arrives (as ``edge-trainer``
does in the field); coverage is the fraction of answers from the ``AFTER``-th label on whose
interval or set held the truth, averaged over ``ORDERS`` random orders of the stream.

Served: what a device answers with since issue 31, by the device's own code: each device is
``edge-trainer``'s serving (:class:`benchmarks.served_device.ServedDevice`), offered the personalized
fleet's models after each round as the daemon offers them.  It holds out the newest fifth of its
training rows (every arm trains on the older ones, as the daemon does), and serves whichever of its
candidates has the best record on them (R² or accuracy, each round's joined by the earlier ones' at
``MEMORY`` a round: ``edge.serving.candidates.remember``) unless its gate keeps the model serving
(``edge.serving.gate``: the margin, the stale rule): its personalized model, its fleet's global
through the cold start (the PFL-DA/FedRep fleet's downlink with a newcomer's personal parts fitted on
its rows) and its model trained alone (``edge.serving.alone``): judged as its copy on the older rows,
served as its copy on every row (``EVERY_ROW``), so the alone candidate's field figure is the served
copy's and its judge score its twin's.  The candidates scored are the ones the device judged (the
round's ``Choice``, handed back by ``ServedDevice``), not rebuilt here.  Check: in every round from 5,
the served answer's field figure is within 2 % (printers' error) or 1 point (welders' accuracy) of the
best of its three candidates' (a model the gate kept from an earlier round is measured against this
round's three).

Target: the personalized answer at least as accurate as both others from round 5 on, on every
machine kind; the served answer within tolerance of its best candidate on every machine; each
machine's interval coverage within ±3 points of the nominal level.

    python -m benchmarks.field_accuracy [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import markdown_table, study_parser, write_result
from benchmarks.served_device import ServedDevice
from cloud_aggregator.local.fleet import pflda_task
from cloud_aggregator.rounds.simulation import ClientData, Simulation
from edge.config import DataConfig
from edge.config_serve import AlertRule
from edge.serving.alerts import Alerts
from edge.serving.candidates import ALONE, ORDER, PERSONAL
from edge.serving.conformal import Calibration, in_range
from edge.serving.model import softmax
from edge.serving.records import Answer, ModelId
from edge.simulated import simulated_printer_dataset, simulated_welder_dataset
from sensors.features.pipeline import labelled_rows
from sensors.features.scaling import standardize_locally
from sensors.layers import SPEED_SCALE
from sensors.sim.welder import GROUP_M_CLASSES, GROUP_M_DOMAINS, WeldCondition, simulate_weld
from trainer_lite.client import derive_rng
from trainer_lite.data import Dataset, newest_split
from trainer_lite.task import TaskSpec

ARMS = ("personalized", "alone", "global")
#: The device's alone copy trained on every training row, the newest included: the copy it serves when
#: its twin on the older rows (the ``alone`` arm's model) wins the judge (``edge.serving.alone``).
EVERY_ROW = "alone on every row"
WELD_MODEL = {"model": "mlp", "model_args": {"sizes": [624, 16, 4], "init": "kaiming"}}
WELD_HP = {"lr": 0.01, "loss": "cross_entropy", "local_steps": 5, "batch_size": 8, "scaling": "local"}
RULE = AlertRule(name="worn_tool", task="tool", value="p:TC4", above=0.8, k=4, n=5, clear_below=0.5)
PRE, WEAR_WELDS, POST = 20, 10, 20


def printer_specs(rounds: int) -> dict[str, TaskSpec]:
    base = pflda_task(rounds=rounds)
    return {
        "personalized": TaskSpec.from_json(json.dumps(base)),
        "alone": TaskSpec.from_json(json.dumps(base | {"algorithm": "indiv"})),
        "global": TaskSpec.from_json(json.dumps(base | {"algorithm": "fedavg"})),
    }


def welder_specs(rounds: int) -> dict[str, TaskSpec]:
    base = {"name": "tool", "rounds": rounds, "seed": 0, **WELD_MODEL, "hparams": WELD_HP}
    return {
        "personalized": TaskSpec.from_json(json.dumps(base | {"algorithm": "fedrep"})),
        "alone": TaskSpec.from_json(json.dumps(base | {"algorithm": "indiv"})),
        "global": TaskSpec.from_json(json.dumps(base | {"algorithm": "fedavg"})),
    }


def weld_rows(device: str, conditions: list[tuple[int, str, str]], tag: str) -> np.ndarray:
    """The 624 features of welds of ``device``'s material pair, one per ``(class index, horn, anvil)``."""
    rng = derive_rng(0, device, "welds")  # the same draw as simulated_welder_dataset: its material pair
    material, weld_time = GROUP_M_DOMAINS[int(rng.integers(len(GROUP_M_DOMAINS)))]
    out = []
    for i, (_, horn, anvil) in enumerate(conditions):
        rec = simulate_weld(WeldCondition(horn, anvil, "clean", material, weld_time),
                            derive_rng(1, device, tag, i), time_scale=0.3, weld_id=f"{device}-{tag}-{i}")  # fmt: skip
        out.append(next(iter(labelled_rows([rec], None, on_error="raise"))).features)
    return np.stack(out)


def cycling(n: int) -> list[tuple[int, str, str]]:
    return [(i % 4, *GROUP_M_CLASSES[i % 4][1]) for i in range(n)]


def wearing(device: str) -> list[tuple[int, str, str]]:
    rng = derive_rng(0, device, "wear")
    out = []
    for i in range(PRE + WEAR_WELDS + POST):
        p_worn = min(1.0, max(0.0, (i - PRE + 1) / WEAR_WELDS))
        k = 3 if rng.random() < p_worn else 0
        out.append((k, *GROUP_M_CLASSES[k][1]))
    return out


@dataclass
class Kind:
    """One machine kind's fleet: each device's training rows and field rows (raw, as stored)."""

    name: str
    metric: str  # "error" (lower is better) or "accuracy"
    specs: dict[str, TaskSpec]
    clients: dict[str, ClientData]  # test = the field rows
    every: dict[str, ClientData] = field(default_factory=dict)  # device -> every training row, field rows
    per_round: dict[str, list[float]] = field(default_factory=dict)  # arm -> fleet mean per round
    #: candidate -> device -> per round (field figure, score on the newest rows) (module docstring)
    candidates: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    per_device: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # arm -> device -> rounds
    downlink: dict[str, dict[str, dict]] = field(default_factory=dict)  # arm -> device -> last downlink
    coverage: dict[str, dict] = field(default_factory=dict)  # device -> interval coverage (interval_coverage)
    meta: dict[str, dict] = field(default_factory=dict)  # device -> its dataset's metadata (classes)
    #: device -> per round (the candidate serving after it, its field figure, whether the gate kept it
    #: from an earlier round)
    served: dict[str, list[tuple[str, float, bool]]] = field(default_factory=dict)


def printers(n: int, rounds: int) -> Kind:
    clients, every, meta = {}, {}, {}
    for i in range(n):
        d = f"printer{i}"
        train, test, meta[d] = simulated_printer_dataset(d, DataConfig(source="simulate-printer"))
        fit = newest_split(train)[0]  # the arms train on the older rows; the newest judge, on the device
        clients[d], every[d] = ClientData(fit, test), ClientData(train, test)
    return Kind("printer", "error", printer_specs(rounds), clients, every, meta=meta)


def welders(n: int, rounds: int, field_welds: int) -> Kind:
    clients, every, meta = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            d = f"welder{i}"
            train, _, meta[d] = simulated_welder_dataset(
                Path(tmp) / d, d, DataConfig(source="simulate-welder")
            )
            fit = newest_split(train)[0]
            conds = cycling(field_welds)
            y = np.array([k for k, _, _ in conds], dtype=np.int64)
            clients[d] = ClientData(fit, Dataset(weld_rows(d, conds, "field"), y))
            every[d] = ClientData(train, clients[d].test)
    return Kind("welder", "accuracy", welder_specs(rounds), clients, every, meta=meta)


def field_figure(kind: Kind, pred: np.ndarray, test: Dataset) -> float:
    """Mean |error| in mm/s (printers) or accuracy (welders) of answers ``pred`` to the field rows."""
    if kind.metric == "error":
        return float(np.mean(np.abs(pred.reshape(-1) - test.y.reshape(-1)))) * SPEED_SCALE
    return float(np.mean(np.argmax(pred, axis=1) == test.y))


def field_score(kind: Kind, algo, shared, local, data: ClientData) -> float:
    return field_figure(kind, np.asarray(algo.predict(shared, local, data.test.x)), data.test)


def run_kind(kind: Kind) -> dict[str, Simulation]:
    with tempfile.TemporaryDirectory() as tmp:
        devices = {d: ServedDevice(d, kind.specs["personalized"].name, Path(tmp) / d) for d in kind.clients}
        return _run_kind(kind, devices)


def _run_kind(kind: Kind, devices: dict[str, ServedDevice]) -> dict[str, Simulation]:
    """Every arm's fleet run; the personalized arm's models offered to each device after each round,
    the candidates it judged kept as the study's (``Kind.candidates``; ``EVERY_ROW``: the alone one's
    field figures, as it serves)."""
    sims = {}
    kind.served = {d: [] for d in kind.clients}
    kind.candidates = {c: {d: [] for d in kind.clients} for c in ORDER}
    for arm, spec in kind.specs.items():
        per_dev: dict[str, list[float]] = {d: [] for d in kind.clients}
        downlink: dict[str, dict] = {}  # device -> the global it trained from this round

        def on_record(rec, fleet, global_params, per_dev=per_dev, downlink=downlink, arm=arm) -> None:
            for d, data in fleet.clients.items():
                per_dev[d].append(field_score(kind, fleet.algo, downlink[d], fleet.local[d], data))
                if arm == "personalized":
                    offer(kind, devices[d], d, rec.round, fleet.algo, downlink[d], fleet.local[d])

        sim = Simulation(spec, kind.clients, on_record=on_record)
        train = sim.fleet.train

        def trained_from(device, shared, *args, train=train, downlink=downlink):
            downlink[device] = shared
            return train(device, shared, *args)

        sim.fleet.train = trained_from  # type: ignore[method-assign] -- sees each device's downlink
        sim.run()
        sims[arm] = sim
        kind.downlink[arm] = downlink
        kind.per_device[arm] = per_dev
    kind.per_device[EVERY_ROW] = {d: [f for f, _ in got] for d, got in kind.candidates[ALONE].items()}
    for arm in (*kind.specs, EVERY_ROW):
        per_dev = kind.per_device[arm]
        kind.per_round[arm] = [float(np.mean(v)) for v in zip(*per_dev.values(), strict=True)]
    return sims


def offer(kind: Kind, device: ServedDevice, d: str, r: int, algo, shared, local) -> None:
    """Round ``r``'s personalized models offered to device ``d``: what serves after it, and each of
    the candidates it judged, by its field figure and its score on the newest rows (the alone
    candidate's field figure is its copy on every row's, which serves in its place)."""
    every = kind.every[d]
    got = device.offer(algo, shared, local, every.train, every.test, r, kind.meta[d])
    assert got is not None and got.choice is not None, f"{d} serves nothing after round {r}: {device.refused}"

    def figure(model) -> float:
        return field_figure(kind, model.outputs(every.test.x), every.test)

    kind.served[d].append((got.model.candidate, figure(got.model), got.kept))
    choice = got.choice
    for name, model in choice.candidates.items():
        served_as = choice.every_row if name == ALONE else model
        kind.candidates[name][d].append((figure(served_as), choice.evidence["scores"][name]))


def time_to_alert(kind: Kind, sims: dict[str, Simulation], work: Path) -> dict[str, dict[str, list]]:
    """Per arm: per welder, welds from the first wearing weld to the raise (None: never), false raises."""
    out: dict[str, dict[str, list]] = {arm: {"welds": [], "false": []} for arm in sims}
    for d, data in kind.clients.items():
        conds = wearing(d)
        raw = weld_rows(d, conds, "wear")
        stream = standardize_locally(np.asarray(data.train.x, np.float64), raw)[
            1
        ]  # the device's own scaling, as the serving model applies it
        for arm, sim in sims.items():
            fleet = sim.fleet
            probs = softmax(
                np.asarray(fleet.algo.predict(kind.downlink[arm][d], fleet.local[d], stream), np.float64)
            )
            alerts = Alerts(d, [RULE], work / arm / d)
            raised_at, false = None, 0
            for i, p in enumerate(probs):
                ans = Answer(d, "tool", "weld", f"{d}-{i}", float(i), float(i), 0.0, ModelId("tool", 0),
                             classes=["TC1", "TC2", "TC3", "TC4"], probabilities=[float(v) for v in p])  # fmt: skip
                for ev in alerts.observe(ans):
                    if ev.state == "raised" and i < PRE:
                        false += 1
                    elif ev.state == "raised" and raised_at is None:
                        raised_at = i - PRE + 1
            out[arm]["welds"].append(raised_at)
            out[arm]["false"].append(false)
    return out


def run(n_printers: int, n_welders: int, rounds: int, field_welds: int) -> tuple[list[Kind], dict]:
    kinds = [printers(n_printers, rounds), welders(n_welders, rounds, field_welds)]
    alerts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            sims = run_kind(kind)
            kind.coverage = interval_coverage(kind, sims)
            if kind.name == "welder":
                alerts = time_to_alert(kind, sims, Path(tmp))
    return kinds, alerts


def at_least_as_good(kind: Kind, from_round: int = 5, arm: str = "personalized") -> dict[str, bool]:
    """Whether ``arm``'s fleet mean is at least as good as each other arm's in every round from ``from_round``."""
    mine = kind.per_round[arm][from_round - 1 :]
    out = {}
    for other in ARMS:
        if other == arm:
            continue
        theirs = kind.per_round[other][from_round - 1 :]
        ok = (
            [a <= b for a, b in zip(mine, theirs, strict=True)]
            if kind.metric == "error"
            else [a >= b for a, b in zip(mine, theirs, strict=True)]
        )
        out[other] = all(ok)
    return out


def per_machine_wins(kind: Kind, from_round: int = 5) -> str:
    """How many machines' personalized answers are at least as good as both others in every round from ``from_round``."""
    better = (lambda a, b: a <= b) if kind.metric == "error" else (lambda a, b: a >= b)
    wins = 0
    for d in kind.clients:
        mine = kind.per_device["personalized"][d][from_round - 1 :]
        wins += all(
            better(m, kind.per_device[o][d][r])
            for o in ("alone", "global")
            for r, m in enumerate(mine, from_round - 1)
        )
    return f"{wins} of {len(kind.clients)}"


def behind(kind: Kind, device: str, other: str, from_round: int = 5) -> tuple[list[int], float]:
    """The rounds from ``from_round`` where ``device``'s personalized answer is worse than its ``other``
    one, and the largest gap (in the metric's units; 0 when never behind)."""
    mine, theirs = kind.per_device["personalized"][device], kind.per_device[other][device]
    sign = 1.0 if kind.metric == "error" else -1.0  # gap > 0: personalized worse
    gaps = [(r + 1, sign * (mine[r] - theirs[r])) for r in range(from_round - 1, len(mine))]
    worse = [(r, g) for r, g in gaps if g > 1e-12]
    return [r for r, _ in worse], max((g for _, g in worse), default=0.0)


def per_machine_table(kind: Kind, from_round: int = 5) -> str:
    rows = []
    for d in kind.clients:
        row: list = [d]
        for other in ("alone", "global"):
            rs, gap = behind(kind, d, other, from_round)
            row += [" ".join(map(str, rs)) or "none", f"{gap:.3f}"]
        rows.append(row)
    return markdown_table(
        ["machine", "rounds behind alone", "worst gap", "rounds behind global", "worst gap"], rows
    )


#: The served answer's tolerance to its best candidate: 2 % of the printers' error, 1 point of accuracy.
TOLERANCE = {"error": 0.02, "accuracy": 0.01}


def served(kind: Kind, device: str) -> list[tuple[str, float, float]]:
    """Per round: ``(what served after it, its field figure, the best candidate's)``; what served is
    the device's (``kind.served``): its candidate's initial, lower case where the gate kept an earlier
    round's model."""
    out = []
    for r, (name, figure, kept) in enumerate(kind.served[device]):
        figures = [kind.candidates[c][device][r][0] for c in ORDER]
        best = min(figures) if kind.metric == "error" else max(figures)
        out.append((name[0] if kept else name[0].upper(), figure, best))
    return out


def within(kind: Kind, figure: float, best: float) -> bool:
    tol = TOLERANCE[kind.metric]
    return figure <= best * (1 + tol) + 1e-12 if kind.metric == "error" else figure >= best - tol - 1e-12


#: Why the newest rows judge the field poorly, per metric (measured: each device's holdout,
#: ``trainer_lite.data.newest_split`` of its training rows).
JUDGE_ROWS = {
    "error": "a printer's newest rows are the last 10 layers of its last print run, all at one speed, "
    "while its field layers are at speeds it never trained on",
    "accuracy": "a welder's newest rows are 9 welds, so one weld moves the judge's accuracy 11 points "
    "and the candidates tie on most rounds",
}


def judge_agrees(kind: Kind, from_round: int = 5) -> str:
    """How often one round's judge alone (its best score on the newest rows) names a candidate within
    tolerance of the field's best."""
    hits = total = 0
    for d in kind.clients:
        for r in range(from_round - 1, len(kind.candidates[PERSONAL][d])):
            got = {c: kind.candidates[c][d][r] for c in ORDER}
            name = max(ORDER, key=lambda c: (got[c][1], -ORDER.index(c)))
            figures = [f for f, _ in got.values()]
            best = min(figures) if kind.metric == "error" else max(figures)
            hits += within(kind, got[name][0], best)
            total += 1
    return f"{hits} of {total}"


def known_late(kind: Kind, from_round: int = 5) -> str:
    """How many machines stay within tolerance of the field's best candidate in every round from
    ``from_round`` when each round serves the candidate whose field figure was best the round
    before: a judge that scored every candidate on every field label as it arrived, known one round
    late.  (Issue 31's judge rules on the device's own rows -- the newest fifth or two fifths, the
    newest whole print run; R², error or log-likelihood; memory 0-0.6 -- reached at most 2 of 6
    printers and 2 of 4 welders on this fleet.)"""
    ok = 0
    for d in kind.clients:
        rounds = len(kind.candidates[PERSONAL][d])
        sign = -1.0 if kind.metric == "error" else 1.0
        misses = 0
        for r in range(max(1, from_round - 1), rounds):
            before = {c: sign * kind.candidates[c][d][r - 1][0] for c in ORDER}
            name = max(ORDER, key=lambda c: (before[c], -ORDER.index(c)))
            figures = [kind.candidates[c][d][r][0] for c in ORDER]
            best = min(figures) if kind.metric == "error" else max(figures)
            misses += not within(kind, kind.candidates[name][d][r][0], best)
        ok += not misses
    return f"{ok} of {len(kind.clients)}"


def served_table(kind: Kind, from_round: int = 5) -> tuple[str, str]:
    """The per-machine table of served candidates and misses, and the summary line."""
    rows, ok = [], 0
    for d in kind.clients:
        got = served(kind, d)
        late = got[from_round - 1 :]
        misses = [r for r, (_, f, b) in enumerate(late, from_round) if not within(kind, f, b)]
        gap = max((f / b - 1 if kind.metric == "error" else b - f) for _, f, b in late) if late else 0.0
        ok += not misses
        rows.append([d, "".join(n for n, _, _ in got), " ".join(map(str, misses)) or "none",
                     f"{100 * gap:.1f} {'%' if kind.metric == 'error' else 'points'}"])  # fmt: skip
    table = markdown_table(
        [
            "machine",
            "served per round (P personal, G global, A alone; p g a: an earlier round's, kept by the gate)",
            "rounds from 5 outside",
            "worst gap",
        ],
        rows,
    )
    what = "2 % of the best candidate's error" if kind.metric == "error" else "1 point of its accuracy"
    return (
        table,
        f"{ok} of {len(kind.clients)} machines' served answer within {what} in every round from {from_round}",
    )


def report(kinds: list[Kind], alerts: dict, rounds: int) -> str:
    parts = []
    for kind in kinds:
        table, summary = served_table(kind)
        served_mean = [float(np.mean([served(kind, d)[r][1] for d in kind.clients])) for r in range(rounds)]
        kind.per_round["served"] = served_mean
        unit = (
            "mean |error| mm/s, lower is better" if kind.metric == "error" else "accuracy, higher is better"
        )
        shown = (*ARMS, EVERY_ROW, "served")
        rows = [[r + 1, *(f"{kind.per_round[a][r]:.3f}" for a in shown)] for r in range(rounds)]
        ok = at_least_as_good(kind)
        parts.append(
            f"### {kind.name}s ({len(kind.clients)} machines; field {unit}; fleet mean per round)\n\n"
            + markdown_table(["round", *shown], rows)
            + f"\n\nPersonalized at least as good as alone from round 5 on: {'yes' if ok['alone'] else 'NO'}; "
            f"as global: {'yes' if ok['global'] else 'NO'}. Machines whose own personalized answer is at least "
            f"as good as both of theirs in every round from 5: {per_machine_wins(kind)}.\n\n"
            f"Per machine, rounds from 5 where its personalized answer is behind (gap in the metric's units):\n\n"
            + per_machine_table(kind)
            + f"\n\nServed (edge-trainer's serving: the best record on the newest rows, through its gate): {summary}.\n\n"
            + table
            + f"\n\nOne round's best score on the newest rows names a candidate within tolerance of the "
            f"field's best in {judge_agrees(kind)} machine-rounds from 5 "
            f"({JUDGE_ROWS[kind.metric]}). Serving each round the candidate whose field figure was best "
            f"the round before (every field label scored for every candidate, one round late) keeps "
            f"{known_late(kind)} machines within tolerance in every round from 5: even the field's own labels, "
            f"one round late, do not name the next round's best (the candidates' field figures cross "
            f"from round to round by more than the tolerance).\n"
        )
    rows = []
    for arm, got in alerts.items():
        hit = [w for w in got["welds"] if w is not None]
        rows.append([arm, " ".join("never" if w is None else str(w) for w in got["welds"]),
                     f"{np.median(hit):.0f}" if hit else "n/a", sum(got["false"])])  # fmt: skip
    parts.append(
        f"### Time to alert (P(TC4) > {RULE.above} in {RULE.k} of the last {RULE.n} welds)\n\n"
        f"{PRE} welds of a new tool, then wear rising to certain over {WEAR_WELDS} welds, then {POST} more; "
        "welds from the first wearing weld to the raise, per welder:\n\n"
        + markdown_table(["model", "welds to alert (per welder)", "median", "false alerts (new tool)"], rows)
    )
    parts.append(coverage_report(kinds))
    return "\n\n".join(parts)


# -- interval coverage (edge.serving.conformal) -------------------------------------------------
LEVEL = 0.9  # [serve] coverage's default
AFTER = 50  # coverage counts once this many labelled rows have arrived
ORDERS = 20  # random orders of each machine's stream, averaged
COVER_WELDS = 200


def coverage_stream(kind: Kind, device: str, data: ClientData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The labelled rows ``device``'s serving model answers after the last round: as it takes them,
    their truths, and as stored (what the trained range is checked on)."""
    if kind.name == "printer":
        x = np.asarray(data.test.x)
        return x, np.asarray(data.test.y).reshape(-1), x
    rng = derive_rng(0, device, "cover")
    conds = [(int(k), *GROUP_M_CLASSES[int(k)][1]) for k in rng.integers(0, 4, COVER_WELDS)]
    raw = weld_rows(device, conds, "cover")
    x = standardize_locally(np.asarray(data.train.x, np.float64), raw)[1]
    return x, np.array([k for k, _, _ in conds]), raw


def interval_coverage(kind: Kind, sims: dict[str, Simulation], arm: str = "personalized") -> dict[str, dict]:
    """Per machine: coverage from the ``AFTER``-th label on per stream order, the mean interval
    half-width (mm/s) or set size, and the fraction of rows within the trained range."""
    out = {}
    classes = ["TC1", "TC2", "TC3", "TC4"]
    for d, data in kind.clients.items():
        fleet = sims[arm].fleet
        x, y, stored = coverage_stream(kind, d, data)
        out_ = np.asarray(fleet.algo.predict(kind.downlink[arm][d], fleet.local[d], x), np.float64)
        train_x = np.asarray(data.train.x, np.float64)
        lo, hi = train_x.min(axis=0), train_x.max(axis=0)
        inside = float(np.mean([bool(in_range(row, lo, hi)) for row in stored]))
        covered, sizes = [], []
        for order in range(ORDERS):
            perm = derive_rng(order, d, "cover-order").permutation(len(y))
            cal, held = Calibration(), []
            for i in perm:
                if kind.name == "printer":
                    expected, truth = out_[i, 0] * SPEED_SCALE, y[i] * SPEED_SCALE
                    c = cal.interval(expected, LEVEL)
                    if len(cal) >= AFTER:
                        lo_i, hi_i = c["interval"]
                        held.append(lo_i <= truth <= hi_i)
                        sizes.append((hi_i - lo_i) / 2)
                    cal.add(abs(expected - truth))
                else:
                    p = softmax(out_[i])
                    c = cal.prediction_set(classes, p.tolist(), LEVEL)
                    if len(cal) >= AFTER:
                        held.append(classes[y[i]] in c["set"])
                        sizes.append(len(c["set"]))
                    cal.add(1.0 - float(p[y[i]]))
            covered.append(float(np.mean(held)))
        out[d] = {
            "coverage": covered,
            "counted": len(held),
            "size": float(np.mean(sizes)),
            "in_range": inside,
        }
    return out


COVERAGE_COLUMNS = ["machine", "coverage (mean)", "over orders", "rows counted", "interval / set",
                    "rows in range", "within ±3 points"]  # fmt: skip


def coverage_report(kinds: list[Kind]) -> str:
    rows = []
    for kind in kinds:
        for d, c in kind.coverage.items():
            mean = float(np.mean(c["coverage"]))
            size = f"±{c['size']:.2f} mm/s" if kind.name == "printer" else f"{c['size']:.2f} classes"
            ok = abs(mean - LEVEL) <= 0.03
            rows.append([d, f"{100 * mean:.1f}%", f"{100 * min(c['coverage']):.1f}-{100 * max(c['coverage']):.1f}%",
                         c["counted"], size, f"{100 * c['in_range']:.0f}%", "yes" if ok else "NO"])  # fmt: skip
    return (
        f"### Interval coverage (nominal {100 * LEVEL:.0f}%, personalized serving models after the last round)\n\n"
        f"Each machine's labelled stream answered in {ORDERS} random orders; the calibration grows with "
        f"every label; counted from the {AFTER}th label on:\n\n" + markdown_table(COVERAGE_COLUMNS, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0,))
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 15, quick 6)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (6 if args.quick else 15)
    n_p, n_w, field_welds = (3, 3, 16) if args.quick else (6, 4, 32)
    began = time.monotonic()
    kinds, alerts = run(n_p, n_w, rounds, field_welds)
    body = report(kinds, alerts, rounds) + f"\n\n({time.monotonic() - began:.0f} s)\n"
    print(body)
    if not args.no_write:
        path = write_result("field_accuracy" + ("_quick" if args.quick else ""), body)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

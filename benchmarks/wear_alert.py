"""Time from wear to alert, beside a welder model at round 8 and at round 40, with no false clear while
the tool stays worn (issue 31, "Measured").

A fleet of simulated welders (:func:`edge.simulated.simulated_welder_dataset`: 48 labelled welds of the
four tool classes each, through the real intake path) trains the weld task in process
(``cloud_aggregator.rounds.simulation``: the devices' ``trainer_lite`` code, the aggregator's round
engine) with FedRep, the fleet's personalized welder algorithm in ``field_accuracy``.  After every round
each device hands the round's models to its serving as ``edge-trainer`` does
(:meth:`edge.serving.server.Server.offer`: the candidates personal / global / alone judged on the newest
rows, the gate, the trained range and first calibration); the model file it serves after round
``EARLY`` and after round ``LATE`` is kept.

Each kept model file is then put where ``edge-trainer`` saves it, in a fresh device state folder whose
:class:`~edge.serving.server.Server` (with the operator guide's ``worn_tool`` rule: P(TC4) > 0.8 in 4 of
the last 5 welds, cleared at 4 of 5 at or below 0.5) loads it at start as the daemon does after a
restart.  A stream of welds goes through the row feed as the welder recorder feeds it
(:class:`edge.feed.RowFeed`: each weld's row, and each maintenance-log label as it lands), and the
serving thread answers every row in order (answer, log, publish, field scores, alert rules) and takes
every label (field accuracy and the conformal calibration); the alerts are read from what it publishes.  The stream is :meth:`edge.recording.simulate.SimulatedWelder.weld_run`, the
simulated welder's own wearing tool and lagging log: new tool (TC1) before weld ``onset``, then each weld
comes out worn (TC4) with a probability rising to 1 over ``WEAR_WELDS`` welds, then ``WORN_TAIL`` more
welds of the worn tool, which is never replaced; one weld every ``SIM_WELD_MIN`` simulated minutes, each
label written ``LABEL_LAG_H`` simulated hours late.  Each welder welds one stream per seed (``--seeds``),
each with its own onset (drawn in ``ONSETS``) and its own weld draws; every kept model answers the very
same welds.  The Server also holds the rule again with ``require_confident`` (only answers whose
conformal prediction set is one class vote: issue 31's "alert rules can require a confident set"),
reported as "confident only".  ``--rounds`` keeps other rounds' models beside round 8 and round 40.

Per model and stream: **welds to alert**, the welds from the onset weld to the one whose answer raised
the alert (onset weld = 1; and the simulated hours between them); **false alerts**, raises before the
onset; **false clears**, clears at or after the onset (the tool stays worn to the end: target none); and
whether the alert is open at the end.  References from the same streams: **oracle**, the same rule on
the true class of each weld (P(TC4) = 1 for a worn weld, 0 for a new one: a perfect classifier under
this rule; a rule that skips votes, "confident only", can beat it), and **first worn label**, the weld with which the log's first worn label
lands (what a device without a model would know).

    python -m benchmarks.wear_alert [--quick] [--rounds 2 8 40] [--seeds 0 1 2] [--welders 4]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from benchmarks.common import markdown_table, study_parser, write_result
from cloud_aggregator.rounds.simulation import ClientData, Simulation
from edge.config import DataConfig, DeviceConfig
from edge.config_serve import AlertRule, ServeConfig
from edge.feed import RowFeed
from edge.recording.simulate import SimulatedWelder
from edge.rows import Row
from edge.serving.alerts import Alerts
from edge.serving.offers import model_path
from edge.serving.records import Answer, ModelId
from edge.serving.server import Server
from edge.simulated import simulated_welder_dataset
from sensors.features.pipeline import labelled_rows
from trainer_lite.client import derive_rng
from trainer_lite.task import TaskSpec

#: The weld task: field_accuracy's personalized welder fleet (FedRep, the small MLP, local scaling).
TASK = {
    "name": "tool",
    "algorithm": "fedrep",
    "model": "mlp",
    "seed": 0,
    "model_args": {"sizes": [624, 16, 4], "init": "kaiming"},
    "hparams": {"lr": 0.01, "loss": "cross_entropy", "local_steps": 5, "batch_size": 8, "scaling": "local"},
}
#: The operator guide's rule (docs/operator-guide.md, docs/watching.md).
RULE = AlertRule(name="worn_tool", task="tool", value="p:TC4", above=0.8, k=4, n=5, clear_below=0.5)
#: The same rule voting only on answers whose conformal prediction set is one class (``require_confident``).
CONFIDENT = AlertRule(name="worn_tool_confident", task="tool", value="p:TC4", above=0.8, k=4, n=5,
                      clear_below=0.5, require_confident=True)  # fmt: skip
RULES = {RULE.name: "", CONFIDENT.name: ", confident only"}  # rule -> its rows' suffix in the tables
EARLY, LATE = 8, 40
#: Wear onsets are drawn in ONSETS; the tool is worn for sure WEAR_WELDS welds after, then welds on worn.
ONSETS, WEAR_WELDS, WORN_TAIL = (10, 25), 10, 30
#: The simulated clock and the maintenance log's lag (edge.serving.demo_welders's).
SIM_WELD_MIN, LABEL_LAG_H = 15.0, 3.0
START = datetime(2026, 1, 5, 6, 0, tzinfo=UTC)
WORN = "TC4"
#: How long a stream's answers may take before the run gives up (only a broken serving thread takes it).
ANSWER_WAIT_S = 120.0


@dataclass
class Weld:
    """One weld of a stream: its row as the recorder feeds it, its true class, the labels landing with it."""

    row: Row
    tool: str
    landed: list[dict[str, str]]


@dataclass
class Stream:
    device: str
    run: str
    onset: int
    welds: list[Weld]


@dataclass
class Outcome:
    """What one alert rule did over one stream (indices are weld indices in the stream)."""

    raises: list[int] = field(default_factory=list)
    clears: list[int] = field(default_factory=list)
    open_at_end: bool = False
    p_worn: list[float] = field(default_factory=list)  # each answer's P(TC4)

    def first_raise(self, onset: int) -> int | None:
        return next((i for i in self.raises if i >= onset), None)

    def welds_to_alert(self, onset: int) -> int | None:
        """Welds from the onset weld (1) to the one whose answer raised the alert; ``None``: never."""
        got = self.first_raise(onset)
        return None if got is None else got - onset + 1

    def false_alerts(self, onset: int) -> int:
        return sum(i < onset for i in self.raises)

    def false_clears(self, onset: int) -> int:
        return sum(i >= onset for i in self.clears)


def device_config(device: str, state_dir: Path) -> DeviceConfig:
    return DeviceConfig(device=device, state_dir=str(state_dir), data=DataConfig(source="state"),
                        serve=ServeConfig(alerts=[RULE, CONFIDENT]))  # fmt: skip


def server(device: str, state_dir: Path, published: list[tuple[str, bytes]]) -> Server:
    state_dir.mkdir(parents=True, exist_ok=True)
    return Server(device_config(device, state_dir), state_dir, lambda t, p: published.append((t, p)))


# -- training: the round engine, each round offered to the device's serving --------------------
@dataclass
class Trained:
    """Per device: where its serving model after each kept round lies, and what it was."""

    files: dict[tuple[str, int], Path] = field(default_factory=dict)  # (device, round) -> model file
    served: dict[tuple[str, int], str] = field(default_factory=dict)  # -> "round r, candidate"
    accuracy: dict[tuple[str, int], float | None] = field(default_factory=dict)  # its newest-rows accuracy


def train(devices: list[str], keep: tuple[int, ...], work: Path) -> Trained:
    """The fleet trained to ``max(keep)`` rounds; the serving model each device holds after each kept round."""
    spec = TaskSpec.from_json(json.dumps(TASK | {"rounds": max(keep)}))
    servers, raw, clients = {}, {}, {}
    for d in devices:
        train_, test, meta = simulated_welder_dataset(
            work / "data" / d, d, DataConfig(source="simulate-welder")
        )
        servers[d] = server(d, work / "train" / d, [])
        raw[d] = (train_, test, meta)
        # A device that answers rows trains without its newest ones: they judge the candidates.
        clients[d] = ClientData(servers[d].holdout(train_)[0], test)
    out = Trained()
    downlink: dict[str, dict] = {}

    def on_record(rec, fleet, _global) -> None:
        for d in devices:
            train_, test, _meta = raw[d]
            servers[d].offer(
                "tool", fleet.algo, downlink[d], fleet.local[d], (train_, test, None), raw[d], rec.round
            )
            if rec.round in keep:
                src = model_path(servers[d].state_dir, "tool")
                dst = work / "kept" / f"{d}-r{rec.round}.safetensors"
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                m = servers[d].models["tool"]
                out.files[d, rec.round] = dst
                out.served[d, rec.round] = f"round {m.round}, {m.candidate}"
                out.accuracy[d, rec.round] = m.reference

    sim = Simulation(spec, clients, on_record=on_record)
    fleet_train = sim.fleet.train

    def trained_from(device, shared, *args):
        downlink[device] = shared  # the global this device trained from: what its serving model pairs with
        return fleet_train(device, shared, *args)

    sim.fleet.train = trained_from  # type: ignore[method-assign]
    sim.run()
    return out


# -- the wearing streams -------------------------------------------------------------------------
def streams(device: str, seeds: list[int], work: Path) -> list[Stream]:
    """A wearing-tool stream of ``device`` per seed, each with its own onset and weld draws."""
    out = []
    for r in seeds:
        onset = int(derive_rng(r, device, "onset").integers(ONSETS[0], ONSETS[1] + 1))
        n = onset + WEAR_WELDS + WORN_TAIL
        sim = SimulatedWelder(device, work / "streams" / device, n, 1.0, wear_from=onset, wear_welds=WEAR_WELDS,
                              label_lag_h=LABEL_LAG_H, sim_weld_min=SIM_WELD_MIN)  # fmt: skip
        welds = []
        for weld in sim.weld_run(f"wear{r}", START):
            feat = next(labelled_rows([weld.recording], None, on_error="raise"))
            at = (
                weld.recording.started_at.timestamp()
            )  # the simulated clock: row time, as a recorder stamps it
            row = Row("weld", feat.weld_id, at, tuple(feat.features.tolist()), schema_hash=feat.schema_hash)
            welds.append(Weld(row, weld.tool, weld.landed))
        out.append(Stream(device, f"wear{r}", onset, welds))
    return out


def watch(stream: Stream, model_file: Path, work: Path) -> dict[str, Outcome]:
    """The kept serving model answering ``stream`` on a device's serving path; what each alert rule did.

    As on a device: the model file lies where ``edge-trainer`` saved it, the Server loads it at start
    and its thread answers the rows and takes the labels a recorder feeds (``edge.feed.RowFeed``),
    in the order they were fed."""
    published: list[tuple[str, bytes]] = []
    state = work / "device"
    dst = model_path(state, "tool")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_file, dst)
    srv = server(stream.device, state, published)
    srv.start()
    feed = RowFeed(state)
    try:
        if "tool" not in srv.models:
            raise SystemExit(f"{model_file}: the Server loaded no model from it; rerun the training")
        for weld in stream.welds:
            for entry in weld.landed:  # the log's labels that land with this weld, as the recorder feeds them
                feed.put_label(entry["weld_id"], entry["tool"])
            feed.put(weld.row)
        # A generous bound, only so that a broken serving thread fails the run instead of hanging it.
        deadline = time.monotonic() + ANSWER_WAIT_S
        while srv.answered["tool"] + sum(srv.refused.get("tool", {}).values()) < len(stream.welds):
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
    finally:
        feed.close()
        srv.close()
    if srv.answered["tool"] != len(stream.welds):
        raise SystemExit(f"{stream.device}: {srv.answered['tool']} of {len(stream.welds)} welds answered "
                         f"(refused: {srv.refused}); see the log above")  # fmt: skip
    index = {w.row.key: i for i, w in enumerate(stream.welds)}
    out = {name: Outcome() for name in RULES}
    for topic, payload in published:
        got = json.loads(payload)
        if "/alert/" in topic:
            o = out[got["rule"]]
            (o.raises if got["state"] == "raised" else o.clears).append(index[got["key"]])
        else:  # an answer, as published (in the order the rows were fed)
            p = float(got["probabilities"][got["classes"].index(WORN)])
            for o in out.values():
                o.p_worn.append(p)
    for alert in srv.alerts.status():
        out[alert["rule"]].open_at_end = True
    return out


def oracle(stream: Stream, work: Path) -> Outcome:
    """The same rule on the true class of every weld: P(TC4) 1 for a worn weld, 0 for a new one."""
    alerts, out = Alerts(stream.device, [RULE], work), Outcome()
    for i, weld in enumerate(stream.welds):
        p = 1.0 if weld.tool == WORN else 0.0
        ans = Answer(stream.device, "tool", "weld", weld.row.key, weld.row.time, weld.row.time, 0.0,
                     ModelId("tool", 0), classes=["TC1", WORN], probabilities=[1 - p, p])  # fmt: skip
        for ev in alerts.observe(ans):
            (out.raises if ev.state == "raised" else out.clears).append(i)
    out.open_at_end = bool(alerts.status())
    return out


def first_worn_label(stream: Stream) -> int | None:
    """Welds from the onset weld (1) to the one with which the log's first worn label lands."""
    for i, weld in enumerate(stream.welds):
        if any(e["tool"] == WORN for e in weld.landed):
            return i - stream.onset + 1
    return None


# -- the study --------------------------------------------------------------------------------
@dataclass
class Result:
    streams: list[Stream]
    trained: Trained
    outcomes: dict[str, list[Outcome]]  # "round 8", "round 40", "oracle" -> one per stream
    labels: list[int | None]
    keep: tuple[int, ...]


def run(n_welders: int, seeds: list[int], keep: tuple[int, ...] = (EARLY, LATE)) -> Result:
    devices = [f"welder{i}" for i in range(n_welders)]
    with tempfile.TemporaryDirectory(prefix="wear-alert-") as tmp:
        work = Path(tmp)
        trained = train(devices, keep, work)
        all_streams = [s for d in devices for s in streams(d, seeds, work)]
        outcomes: dict[str, list[Outcome]] = {
            f"round {r}{suffix}": [] for suffix in RULES.values() for r in keep
        }
        outcomes["oracle"] = []
        for j, s in enumerate(all_streams):
            for r in keep:
                got = watch(s, trained.files[s.device, r], work / "watch" / f"{j}-r{r}")
                for name, suffix in RULES.items():
                    outcomes[f"round {r}{suffix}"].append(got[name])
            outcomes["oracle"].append(oracle(s, work / "oracle" / str(j)))
        labels = [first_worn_label(s) for s in all_streams]
    return Result(all_streams, trained, outcomes, labels, keep)


def spread(values: list[int | None]) -> str:
    """Median and range of the values that exist, and how many never came."""
    got = [v for v in values if v is not None]
    never = len(values) - len(got)
    if not got:
        return f"never ({never})"
    text = f"{np.median(got):g} ({min(got)}-{max(got)})"
    return text + (f", never in {never}" if never else "")


def summary_rows(res: Result) -> list[list[object]]:
    rows = []
    for name, outs in res.outcomes.items():
        welds = [o.welds_to_alert(s.onset) for o, s in zip(outs, res.streams, strict=True)]
        hours = [None if w is None else (w - 1) * SIM_WELD_MIN / 60 for w in welds]
        hours_text = spread(hours) if any(h is not None for h in hours) else "n/a"
        rows.append([name, spread(welds), hours_text,
                     sum(o.false_alerts(s.onset) for o, s in zip(outs, res.streams, strict=True)),
                     sum(o.false_clears(s.onset) for o, s in zip(outs, res.streams, strict=True)),
                     f"{sum(o.open_at_end for o in outs)} of {len(outs)}"])  # fmt: skip
    rows.append(["first worn label", spread(res.labels),
                 spread([None if w is None else (w - 1) * SIM_WELD_MIN / 60 for w in res.labels]),
                 "", "", ""])  # fmt: skip
    return rows


def per_stream_rows(res: Result) -> list[list[object]]:
    rows = []
    names = list(res.outcomes)
    for j, s in enumerate(res.streams):
        cells: list[object] = [s.device, s.run, s.onset]
        for name in names:
            o = res.outcomes[name][j]
            w = o.welds_to_alert(s.onset)
            extra = []
            if o.false_alerts(s.onset):
                extra.append(f"{o.false_alerts(s.onset)} false")
            if o.false_clears(s.onset):
                extra.append(
                    f"cleared at {', '.join(str(i - s.onset + 1) for i in o.clears if i >= s.onset)}"
                )
            cells.append(("never" if w is None else str(w)) + (f" ({'; '.join(extra)})" if extra else ""))
        cells.append("never" if res.labels[j] is None else res.labels[j])
        rows.append(cells)
    return rows


def model_rows(res: Result) -> list[list[object]]:
    devices = sorted({s.device for s in res.streams})
    rows = []
    for d in devices:
        cells: list[object] = [d]
        for r in res.keep:
            acc = res.trained.accuracy[d, r]
            cells.append(f"{res.trained.served[d, r]}" + ("" if acc is None else f", {acc:.2f}"))
        rows.append(cells)
    return rows


def separation(res: Result, name: str) -> list[str]:
    """Over all streams: how many of a new tool's welds ``name`` answered with P(TC4) over the raise
    threshold, and how many worn welds at or below the clear threshold (each with the extreme value)."""
    new, worn = [], []
    for o, s in zip(res.outcomes[name], res.streams, strict=True):
        for p, w in zip(o.p_worn, s.welds, strict=True):
            (worn if w.tool == WORN else new).append(p)
    over = sum(p > RULE.above for p in new)
    under = sum(p <= RULE.clear_below for p in worn)
    return [
        f"{over} of {len(new)} (largest {max(new):.3f})",
        f"{under} of {len(worn)} (least {min(worn):.3f})",
    ]


def no_later(res: Result, early: str, late: str) -> str:
    """In how many streams ``late`` raised no later than ``early`` (a stream where only ``early`` raised
    counts against ``late``)."""
    hits = 0
    for a, b, s in zip(res.outcomes[early], res.outcomes[late], res.streams, strict=True):
        wa, wb = a.welds_to_alert(s.onset), b.welds_to_alert(s.onset)
        hits += wb is not None and (wa is None or wb <= wa)
    return f"{hits} of {len(res.streams)}"


def report(res: Result) -> str:
    models = [f"round {r}" for r in res.keep]
    late = models[-1]
    margins = [[m, *separation(res, m)] for m in models]
    later = "; ".join(f"no later than {m} in {no_later(res, m, late)}" for m in models[:-1])
    lines = [
        f"{len({s.device for s in res.streams})} welders, {len(res.streams)} wearing-tool streams "
        f"(onset drawn in {ONSETS[0]}-{ONSETS[1]}, worn for sure {WEAR_WELDS} welds later, then "
        f"{WORN_TAIL} more worn welds; one weld per {SIM_WELD_MIN:g} simulated minutes, labels "
        f"{LABEL_LAG_H:g} h late). Rule `{RULE.name}`: P({RULE.value[2:]}) > {RULE.above} in {RULE.k} of the "
        f"last {RULE.n} welds, cleared at {RULE.k} of {RULE.n} at or below {RULE.clear_below}.",
        "",
        "Welds from the onset weld (1) to the alert, median (range) over the streams; hours of the "
        "simulated clock from the onset weld to the raising weld; false alerts (raised before the onset), "
        "false clears (cleared at or after the onset: the tool stays worn), alert open at the end:",
        "",
        markdown_table(
            ["model", "welds to alert", "hours to alert", "false alerts", "false clears", "open at end"],
            summary_rows(res),
        ),
        "",
        f"{late} raised {later} streams; the oracle no later than {late} in {no_later(res, late, 'oracle')}.",
        "",
        "Single answers on the wrong side of the rule's thresholds (the k of n vote is what keeps them from "
        "raising or clearing):",
        "",
        markdown_table(
            [
                "model",
                f"new tool's welds with P(TC4) > {RULE.above}",
                f"worn welds with P(TC4) <= {RULE.clear_below}",
            ],
            margins,
        ),
        "",
        "The serving model each welder held (the round it is from, its candidate, its accuracy on the "
        "newest rows):",
        "",
        markdown_table(["welder", *models], model_rows(res)),
        "",
        "Per stream (welds to alert; a note where a rule raised before the onset or cleared after it):",
        "",
        markdown_table(
            ["welder", "stream", "onset weld", *res.outcomes, "first worn label"], per_stream_rows(res)
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0, 1, 2))
    parser.add_argument("--welders", type=int, default=None, help="welders in the fleet (default 4, quick 2)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[EARLY, LATE],
                        help=f"the rounds whose serving models answer (default {EARLY} {LATE})")  # fmt: skip
    args = parser.parse_args(argv)  # --seeds: one wearing stream per welder and seed
    n_welders = args.welders or (2 if args.quick else 4)
    keep = tuple(sorted(set(args.rounds)))
    if n_welders < 2 or keep[0] < 1 or min(args.seeds) < 0:
        print(f"--welders must be >= 2, --rounds >= 1 and --seeds >= 0, got {n_welders}, "
              f"{' '.join(map(str, keep))} and {' '.join(map(str, args.seeds))}", file=sys.stderr)  # fmt: skip
        return 2
    logging.getLogger("edge").setLevel(logging.ERROR)  # each raise is logged as on a device: noise here
    began = time.monotonic()
    res = run(n_welders, sorted(set(args.seeds)), keep)
    body = report(res) + f"\n\n({time.monotonic() - began:.0f} s)\n"
    print(body)
    if not args.no_write:
        path = write_result("wear_alert" + ("_quick" if args.quick else ""), body)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

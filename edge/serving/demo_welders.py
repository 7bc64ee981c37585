"""``python -m edge.serving.demo_welders WORKDIR``: a pair of simulated welders, one whose tool wears,
watched weld by weld, for ``make demo`` (``cloud_aggregator.local.demo``, which may not import
``edge`` and so runs this).

Each welder records its dataset through the real intake path (:func:`edge.simulated.simulated_welder_dataset`:
48 welds of the four tool classes, labelled), trains its own model alone on it with the device's
NumPy trainer (``indiv``: :func:`trainer_lite.client.participate`, the call a round makes) and serves
it as the device does (:class:`edge.serving.model.ServingModel`: its own scaling, its answer per
row).  Then each welds on (:meth:`edge.recording.simulate.SimulatedWelder.weld_run`, the simulated
welder's own wear and log rule, replayed in memory): one welder's tool starts to wear at weld
``WEAR_FROM``, the other's never does; every weld is answered at once, the answer goes to the
device's alert rule (:class:`edge.serving.alerts.Alerts`: :data:`RULE`) and waits for its label,
which the maintenance log writes ``LABEL_LAG_H`` simulated hours later (field accuracy:
:class:`edge.serving.field.FieldScores`).

One JSON object per welder on stdout: the weld at which wear starts (``wear_from``), the first weld
that came out worn (``first_worn``), the weld whose answer raised the alert (``alert``), the weld
with which the first worn label landed in the log (``worn_label``), how many raises, and the field
accuracy over the welds scored by the end.  ``null``: never.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from edge.config import DataConfig
from edge.config_serve import AlertRule
from edge.recording.simulate import SimulatedWelder
from edge.rows import Row
from edge.serving.alerts import Alerts
from edge.serving.field import FieldScores
from edge.serving.model import ServingModel
from edge.simulated import simulated_welder_dataset
from sensors.features.pipeline import labelled_rows
from sensors.features.scaling import Standardizer
from trainer_lite.algorithms import make_client
from trainer_lite.client import initial_local, participate
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

#: The welders' model: the e2e serving tests' weld task, trained alone (nothing shared).
TASK = {
    "name": "tool",
    "algorithm": "indiv",
    "model": "mlp",
    "rounds": 15,
    "seed": 0,
    "model_args": {"sizes": [624, 16, 4], "init": "kaiming"},
    "hparams": {"lr": 0.01, "loss": "cross_entropy", "local_steps": 5, "batch_size": 8, "scaling": "local"},
}
#: The demo's alert rule: P(worn) > 0.8 in 4 of the last 5 welds.
RULE = AlertRule(name="worn_tool", task="tool", value="p:TC4", above=0.8, k=4, n=5, clear_below=0.5)
#: The wearing tool: new until weld WEAR_FROM, then worn for sure WEAR_WELDS welds later.
WEAR_FROM, WEAR_WELDS = 12, 6
#: One weld every SIM_WELD_MIN simulated minutes; the log writes each label LABEL_LAG_H hours late.
SIM_WELD_MIN, LABEL_LAG_H = 15.0, 3.0
LAG_WELDS = round(LABEL_LAG_H * 60 / SIM_WELD_MIN)
#: Enough welds for the last wearing weld's label to land.
WELDS = WEAR_FROM + WEAR_WELDS + LAG_WELDS
#: The never-wearing welder's tool starts wearing long after the run.
NEVER = 10**6
START = datetime(2026, 1, 5, 6, 0, tzinfo=UTC)


def train_alone(device: str, state_dir: Path) -> ServingModel:
    """The welder's dataset, recorded; its model trained alone and made a serving model as the device makes one."""
    train, test, meta = simulated_welder_dataset(state_dir, device, DataConfig(source="simulate-welder"))
    spec = TaskSpec.from_json(json.dumps(TASK))
    algo = make_client(spec)
    scaler = Standardizer.fit(train.x)  # scaling = "local": the device's own training rows
    scaled = Dataset(scaler.transform(train.x), train.y)
    local = initial_local(algo, device)
    for r in range(1, spec.rounds + 1):
        _, local = participate(algo, device, {}, local, scaled, None, round_=r, phase="train")
    model = ServingModel(device, spec.name, spec.to_json(), spec.rounds, {}, local, width=train.x.shape[1],
                         schema_hash=meta["schema_hash"], classes=list(meta["classes"]),
                         scale_mean=scaler.mean, scale_std=scaler.std, _algo=algo)  # fmt: skip
    model.reference, _ = model.score(test)
    return model


def watch(device: str, state_dir: Path, wear_from: int) -> dict:
    """One welder trained, then welding on; what happened, weld by weld (see the module docstring)."""
    model = train_alone(device, state_dir)
    welder = SimulatedWelder(device, state_dir, WELDS, 1.0, wear_from=wear_from, wear_welds=WEAR_WELDS,
                             label_lag_h=LABEL_LAG_H, sim_weld_min=SIM_WELD_MIN)  # fmt: skip
    alerts = Alerts(device, [RULE], state_dir / "serving")
    field = FieldScores(window=WELDS, margin=0.1)
    out: dict = {"device": device, "wear_from": wear_from if wear_from < WELDS else None, "first_worn": None,
                 "alert": None, "raises": 0, "worn_label": None, "test_accuracy": model.reference,
                 "rule": f"P({RULE.value[2:]}) > {RULE.above} in {RULE.k} of the last {RULE.n} welds",
                 "label_lag_h": LABEL_LAG_H, "lag_welds": LAG_WELDS}  # fmt: skip
    for weld in welder.weld_run("demo", START):
        out["material"] = weld.material
        for entry in weld.landed:  # the log's labels that land with this weld
            field.label(entry["weld_id"], entry["tool"])
            if entry["tool"] == "TC4" and out["worn_label"] is None:
                out["worn_label"] = weld.index
        if weld.tool == "TC4" and out["first_worn"] is None:
            out["first_worn"] = weld.index
        row = next(labelled_rows([weld.recording], None, on_error="raise"))
        at = weld.recording.started_at.timestamp()
        answer = model.answer(Row("weld", row.weld_id, at, tuple(row.features.tolist()),
                                  schema_hash=row.schema_hash), now=at)  # fmt: skip
        field.answered(answer)
        for ev in alerts.observe(answer):
            if ev.state == "raised":
                out["raises"] += 1
                out["alert"] = weld.index if out["alert"] is None else out["alert"]
    out["field_accuracy"] = field.figure(TASK["name"])
    out["scored"] = field.scored[TASK["name"]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m edge.serving.demo_welders", description=__doc__.split("\n")[0]
    )
    p.add_argument("workdir", type=Path, help="a folder for the welders' state (created)")
    args = p.parse_args(argv)
    try:
        args.workdir.mkdir(parents=True, exist_ok=True)
        # A fresh folder per run: a reused one would hold the last run's welds (skipped as seen) and its
        # open alert (not raised again).
        run = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
    except OSError as exc:
        print(f"cannot create a folder in {args.workdir}: {exc}; give a writable folder", file=sys.stderr)
        return 2
    for device, wear_from in (("welder1", WEAR_FROM), ("welder2", NEVER)):
        print(json.dumps(watch(device, run / device, wear_from)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

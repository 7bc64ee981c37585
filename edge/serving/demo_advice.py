"""``python -m edge.serving.demo_advice --budget B STATE_DIR...``: each simulated printer's speed advice,
for ``make demo`` (``cloud_aggregator.local.demo``, which may not import ``edge`` and so runs this).

A simulated printer (``edge-trainer --simulate printer``) has no row feed and so no serving model;
its model is what the device holds after its last round of each task (``tasks/<task>/local.safetensors``:
its trained shared part and its own local part).  The advice is :func:`edge.serving.advice.speed_advice`
of that model, as a serving model would give it (bounded by its training rows: no advice when every
row it trained on vibrated above the budget).  ``truth`` is what the simulated printer really
does: the highest speed setting it was recorded at (train and test rows together) whose mean
vibration is within the budget.  One JSON object per device on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from edge.config import DataConfig
from edge.serving.advice import speed_advice
from edge.serving.model import ServingModel
from edge.simulated import simulated_printer_dataset
from edge.task_state import load_task_state
from ioft_protocol.state import StateError
from sensors.layers import SPEED_SCALE


def advice(state_dir: Path, task: str, budget: float) -> float | None:
    """The advice of the model ``state_dir``'s device holds for ``task`` (``None``: no state, or none)."""
    try:
        state = load_task_state(state_dir / "tasks" / task / "local.safetensors")
    except StateError:
        return None
    if state is None:
        return None
    train, _, _ = simulated_printer_dataset(state_dir.name, DataConfig(source="simulate-printer"))
    model = ServingModel(state_dir.name, task, state.spec_json, state.answered[0] if state.answered else 0,
                         dict(state.upload), dict(state.local), width=1,
                         speed_max=float(train.y.max()) * SPEED_SCALE, sigma_min=float(train.x[:, 0].min()))  # fmt: skip
    return speed_advice(model, budget).speed


def truth(device: str, budget: float) -> float | None:
    train, test, _ = simulated_printer_dataset(device, DataConfig(source="simulate-printer"))
    x = np.concatenate([train.x[:, 0], test.x[:, 0]])
    speed = np.round(np.concatenate([train.y[:, 0], test.y[:, 0]]) * SPEED_SCALE)
    within = [float(s) for s in np.unique(speed) if x[speed == s].mean() <= budget]
    return max(within) if within else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edge.serving.demo_advice", description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, required=True, help="the vibration budget (sigma_a)")
    p.add_argument("--task", action="append", required=True, help="a task whose model advises (repeatable)")
    p.add_argument("state_dirs", type=Path, nargs="+", help="each simulated printer's state folder")
    args = p.parse_args(argv)
    if not args.budget > 0:
        print(f"--budget must be > 0, got {args.budget}", file=sys.stderr)
        return 2
    for folder in args.state_dirs:
        row = {"device": folder.name, "truth": truth(folder.name, args.budget)}
        row |= {task: advice(folder, task, args.budget) for task in args.task}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

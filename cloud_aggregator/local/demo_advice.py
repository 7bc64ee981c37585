"""The demo's speed advice table: each printer's advice under a vibration budget, from PFL-DA's
personal model beside the printer's model trained alone (``indiv``), and what the simulated printer
really does within that budget.

The advice is computed on the device side (``python -m edge.serving.demo_advice``, run as its own
process: the cloud does not import ``edge``) from the models the devices hold after the demo's rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: The vibration budget (sigma_a): below the slow end of most simulated printers' own runs, so a
#: printer's model must extrapolate there (where borrowing the fleet's curve pays off).
BUDGET = 1.2
ADVISING = ("speed-pflda", "speed-indiv")


def device_side_env() -> dict[str, str]:
    """The environment for a ``python -m edge...`` child: this process's, with its import path."""
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *sys.path) if p)
    )


def advice_rows(work: Path, devices: list[str], budget: float = BUDGET) -> list[dict] | str:
    """One dict per printer (``device``, ``truth`` and each advising task's speed); a string: why not."""
    env = device_side_env()
    tasks = [a for t in ADVISING for a in ("--task", t)]
    done = subprocess.run(
        [sys.executable, "-m", "edge.serving.demo_advice", "--budget", str(budget), *tasks,
         *(str(work / d) for d in devices)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        return (
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        )
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _mm_s(v: float | None) -> str:
    return f"{v:>8.1f}" if v is not None else f"{'-':>8}"


def print_advice(work: Path, devices: list[str], budget: float = BUDGET) -> None:
    """Print the advice table (or one line saying why there is none: the demo itself still succeeded)."""
    rows = advice_rows(work, devices, budget)
    if isinstance(rows, str):
        print(f"\n(no speed advice: {rows})")
        return
    print(f"\nSpeed advice (mm/s) under a vibration budget of sigma_a <= {budget}: the highest speed each model "
          "expects within it (truth: the simulated printer's fastest setting within it):")  # fmt: skip
    print(f"{'printer':>10} {'PFL-DA':>8} {'indiv':>8} {'truth':>8}")
    for row in rows:
        print(
            f"{row['device']:>10} {_mm_s(row.get(ADVISING[0]))} {_mm_s(row.get(ADVISING[1]))} {_mm_s(row['truth'])}"
        )

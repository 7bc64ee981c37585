"""The demo's welder table: two simulated welders, one whose tool starts to wear; the weld at which its
alert is raised, beside the weld at which the lagging maintenance log first confirms the wear.

The welders run on the device side (``python -m edge.serving.demo_welders``, its own process: the
cloud does not import ``edge``), in the background while the demo's newcomer rounds go on, so they
add little to the demo's time; :func:`print_welders` waits for them and prints the table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cloud_aggregator.local.demo_advice import device_side_env

TIMEOUT_S = 120


def start_welders(work: Path) -> subprocess.Popen:
    """The device-side welders, started in ``work/welders`` (their datasets, models and alerts)."""
    return subprocess.Popen(
        [sys.executable, "-m", "edge.serving.demo_welders", str(work / "welders")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=device_side_env(),
    )  # fmt: skip


def welder_rows(proc: subprocess.Popen) -> list[dict] | str:
    """One dict per welder (see ``edge.serving.demo_welders``); a string: why there are none."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"the welders took over {TIMEOUT_S} s"
    if proc.returncode != 0:
        return err.strip().splitlines()[-1] if err.strip() else f"exit status {proc.returncode}"
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _weld(v: int | None, width: int) -> str:
    return f"{v:>{width}}" if v is not None else f"{'-':>{width}}"


def print_welders(proc: subprocess.Popen) -> None:
    """Print the welder table (or one line saying why there is none: the demo itself still succeeded)."""
    rows = welder_rows(proc)
    if isinstance(rows, str) or not rows:
        print(f"\n(no welder table: {rows or 'no welders'})")
        return
    first = rows[0]
    print(f"\nTwo simulated welders, each answering its welds with its own model (trained alone); alert: "
          f"{first['rule']}; the maintenance log labels each weld {first['label_lag_h']:g} h "
          f"({first['lag_welds']} welds) later. Weld numbers:")  # fmt: skip
    print(f"{'welder':>8} {'material':>8} {'wear starts':>11} {'first worn':>10} {'alert raised':>12} "
          f"{'worn label lands':>16} {'field accuracy':>14}")  # fmt: skip
    for r in rows:
        acc = f"{r['field_accuracy']:>14.2f}" if r.get("field_accuracy") is not None else f"{'-':>14}"
        print(f"{r['device']:>8} {r['material']:>8} {_weld(r['wear_from'], 11)} {_weld(r['first_worn'], 10)} "
              f"{_weld(r['alert'], 12)} {_weld(r['worn_label'], 16)} {acc}")  # fmt: skip

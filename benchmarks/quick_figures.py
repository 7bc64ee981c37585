"""The figures each deterministic study's ``--quick`` mode gives, recorded so that drift shows.

``python -m benchmarks.quick_figures [--write] [NAME ...]``

A results file stays true only while its command still produces it.  The full runs take
minutes to hours, so the test suite cannot re-run them; it re-runs their ``--quick`` modes
instead (``tests/studies/test_results_stay_true.py``) and compares them with the figures
recorded here, in ``benchmarks/results/quick/<name>.json`` (with the command, commit and
machine that produced them).  When a study's code changes its quick figures, the test fails
and names the commands to run: this one with ``--write NAME``, and the study's full command
from the header of its results file.

Only deterministic studies are here (seeded, no wall-clock in the figures); timing
benchmarks are checked for structure by their own ``--quick`` tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, commit_line, machine_line

QUICK = RESULTS / "quick"
Figures = dict[str, float]


@dataclass(frozen=True)
class QuickStudy:
    """One study's quick mode: the command it stands for and how to get its figures in process."""

    command: str
    figures: Callable[[], Figures]
    needs_printer_data: bool = False


def printer_data() -> Path:
    """The six-printer CSVs: ``$IOFT_PRINTER_DATA`` or the studies' default ``../shared/data/printers``."""
    from benchmarks.pflda_printers import DEFAULT_DATA

    return Path(os.environ.get("IOFT_PRINTER_DATA") or DEFAULT_DATA)


# Each study's figures from the output its quick run returns (the study's own quick test passes
# the output it already has, so one run serves both), and the quick run itself.
QUICK_ARGV = ["--quick", "--no-write", "--seeds", "0", "--workers", "2"]
NEWCOMER_SEEDS = (0, 1)


def printer_figures(result: dict[str, float]) -> Figures:
    from benchmarks.pflda_printers import LABELS

    return {LABELS[k]: float(v) for k, v in result.items()}


def _pflda_printers() -> Figures:
    from benchmarks import pflda_printers as printers

    return printer_figures(printers.quick(printer_data(), (0, 1, 2)))


def sine_figures(runs: Sequence[dict]) -> Figures:
    out: Figures = {}
    for r in runs:
        out[f"{r['method']} last-5 mean"] = float(np.mean(r["curve"][-5:]))
        out[f"{r['method']} spread"] = float(r["spread"])
    return out


def _pflda_sine() -> Figures:
    from benchmarks import pflda_sine as sine

    return sine_figures(sine.run_study(sine.quick_config(), sine.METHODS, [0], workers=1))


def newcomer_figures(curves_by_seed: dict[int, dict[str, np.ndarray]]) -> Figures:
    return {
        f"seed {seed} {label} round {i + 1}": float(v)
        for seed, curves in curves_by_seed.items()
        for label, curve in curves.items()
        for i, v in enumerate(curve)
    }


def newcomer_quick(seed: int) -> dict[str, np.ndarray]:
    """PFL-DA with and without its cold start, 20 simulated rounds then 2 with the newcomer."""
    from benchmarks.newcomer import METHODS, run_fleet, simulated_fleet

    pflda = [m for m in METHODS if m[0] in ("PFL-DA", "PFL-DA (no cold start)")]
    return run_fleet(simulated_fleet(seed), seed, rounds_before=20, rounds_after=2, methods=pflda)[0]


def _newcomer() -> Figures:
    return newcomer_figures({seed: newcomer_quick(seed) for seed in NEWCOMER_SEEDS})


def feddar_figures(out: dict) -> Figures:
    return {r.job.method: float(r.final) for r in out["results"]}


def _feddar() -> Figures:
    from benchmarks import feddar_synthetic as study

    return feddar_figures(study.main(QUICK_ARGV))


def gifair_figures(out: dict) -> Figures:
    return {
        f"lam {r['lam']} {k}": float(v)
        for r in out["results"]
        for k, v in r["scores"].items()
        if isinstance(v, int | float)
    }


def _gifair() -> Figures:
    from benchmarks import gifair as study

    return gifair_figures(study.main(QUICK_ARGV))


def perpca_figures(out: dict) -> Figures:
    figs: Figures = {}
    for r in out["synth"]:
        figs[f"alpha {r['alpha']:g} theta"] = float(r["theta"])
        for part in ("decoupled", "combined"):
            figs.update({f"alpha {r['alpha']:g} {part} {m}": float(v) for m, v in r[part].items()})
    return figs


def _perpca() -> Figures:
    from benchmarks import perpca as study

    return perpca_figures(study.main(QUICK_ARGV))


STUDIES: dict[str, QuickStudy] = {
    "pflda_printers": QuickStudy(
        "python -m benchmarks.pflda_printers --quick --seeds 0 1 2", _pflda_printers, True
    ),
    "pflda_sine": QuickStudy("python -m benchmarks.pflda_sine --quick", _pflda_sine),
    "newcomer": QuickStudy(
        "benchmarks.newcomer.run_fleet(simulated_fleet(seed), seed, 20, 2), PFL-DA ± cold start, seeds 0 1",
        _newcomer,
    ),
    "feddar_synthetic": QuickStudy(
        "python -m benchmarks.feddar_synthetic --quick --no-write --seeds 0 --workers 2", _feddar
    ),
    "gifair": QuickStudy("python -m benchmarks.gifair --quick --no-write --seeds 0 --workers 2", _gifair),
    "perpca": QuickStudy("python -m benchmarks.perpca --quick --no-write --seeds 0 --workers 2", _perpca),
}


def path_of(name: str) -> Path:
    return QUICK / f"{name}.json"


def recorded(name: str) -> dict:
    """What ``benchmarks/results/quick/<name>.json`` holds (``{}`` when nothing is recorded)."""
    path = path_of(name)
    return json.loads(path.read_text()) if path.exists() else {}


def write(name: str, figures: Figures) -> Path:
    """Record ``figures`` for ``name`` with the command, commit and machine that gave them."""
    QUICK.mkdir(parents=True, exist_ok=True)
    study = STUDIES[name]
    doc = {
        "study_command": study.command,
        "regenerate": f"python -m benchmarks.quick_figures --write {name}",
        "commit": commit_line(),
        "machine": machine_line(),
        "figures": {k: figures[k] for k in sorted(figures)},
    }
    path = path_of(name)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def drift(name: str, figures: Figures, rtol: float = 1e-9, atol: float = 1e-12) -> list[str]:
    """One line per figure that differs from the recorded one (or is missing on either side)."""
    want = recorded(name).get("figures", {})
    lines = [f"{k}: recorded, not produced" for k in sorted(set(want) - set(figures))]
    lines += [f"{k}: produced, not recorded" for k in sorted(set(figures) - set(want))]
    for k in sorted(set(want) & set(figures)):
        if not np.isclose(figures[k], want[k], rtol=rtol, atol=atol, equal_nan=True):
            lines.append(f"{k}: recorded {want[k]!r}, now {figures[k]!r}")
    return lines


def assert_no_drift(name: str, figures: Figures) -> None:
    """For a study's quick test: fail, naming what to rerun, when its figures drifted."""
    lines = drift(name, figures)
    if lines:
        raise AssertionError(
            f"{name}'s quick figures drifted from benchmarks/results/quick/{name}.json:\n  "
            + "\n  ".join(lines)
            + f"\nIf the change is meant: python -m benchmarks.quick_figures --write {name}, and rerun the "
            "full command named in the header of its results file."
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.quick_figures", description=__doc__.split("\n")[0]
    )
    ap.add_argument("names", nargs="*", help=f"studies (default: all of {', '.join(STUDIES)})")
    ap.add_argument("--write", action="store_true", help="record the figures (else: compare)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in STUDIES]
    if unknown:
        ap.exit(2, f"unknown studies {unknown}; choose from {', '.join(STUDIES)}\n")
    bad = 0
    for name in args.names or list(STUDIES):
        figures = STUDIES[name].figures()
        if args.write:
            print(f"{name}: {len(figures)} figures -> {write(name, figures)}")
            continue
        lines = drift(name, figures)
        bad += bool(lines)
        print(
            f"{name}: "
            + ("matches its recorded figures" if not lines else "DRIFTED\n  " + "\n  ".join(lines))
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

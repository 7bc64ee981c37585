"""Shared plumbing for the studies and benchmarks: progress, tables, plots, results files.

Every study is ``python -m benchmarks.<name> [--quick] [--seeds ...]``: it shows
progress on stderr, prints a results table on stdout and writes the same table
(plus a PNG where it plots) to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
#: The packages whose ``results/`` folders hold results files: the studies, the checks the suite
#: drives (``checks/``) and the deployment checks (``deploy/``).
RESULT_PACKAGES = ("benchmarks", "checks", "deploy")
T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """A progress bar on stderr (tqdm when installed, a plain counter otherwise)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the device extra has no tqdm
        items = list(items)
        for i, item in enumerate(items, 1):
            print(f"\r{desc}: {i}/{len(items)}", end="", file=sys.stderr, flush=True)
            yield item
        print(file=sys.stderr)
        return
    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    vals = [float(v) for v in values]
    return float(np.mean(vals)), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def fmt_mean_std(values: Sequence[float], digits: int = 3) -> str:
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def machine_line() -> str:
    """One line naming the machine the figures were measured on."""
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"numpy {np.__version__}, measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


def remove_scratch(work: Path) -> None:
    """Delete a case's scratch folder once its processes have stopped (``IOFT_KEEP_WORK=1`` keeps it
    for a look at the logs): the suite runs the ``--quick`` modes on every CI run."""
    if not os.environ.get("IOFT_KEEP_WORK"):
        shutil.rmtree(work, ignore_errors=True)


def commit_line() -> str:
    """The commit the running code came from, and whether the tree had uncommitted changes to
    tracked files (a result from a dirty tree cannot be regenerated from its commit alone).
    Read once, when this module is first imported: a long run records where it started."""
    return _COMMIT


def _read_commit() -> str:
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    if shutil.which("git") is None:  # e.g. the arm64 root the device tests run in
        return "unknown (git is not installed)"
    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return "unknown (not a git checkout)"
    # Results files are outputs, not the code that produced them.
    dirty = git(
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        *(f":!{p}/results" for p in RESULT_PACKAGES),
    )
    return f"{sha}" + (" + uncommitted changes" if dirty else "")


_COMMIT = _read_commit()


def header(name: str, command: str | None = None) -> str:
    """The lines every results file starts with: title, command, commit, machine."""
    # The module that ran (a results file may be named apart from it, e.g. serve_latency_hung_moonraker).
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = spec.name if spec is not None and spec.name.startswith("benchmarks.") else "benchmarks." + name
    cmd = command or f"python -m {module} " + " ".join(sys.argv[1:])
    return f"# {name}\n\nCommand: `{cmd.strip()}`  \nCommit: {commit_line()}  \nMachine: {machine_line()}\n"


def write_result(name: str, body: str, *, command: str | None = None, folder: Path | None = None) -> Path:
    """Write ``<folder>/<name>.md`` (``benchmarks/results/`` unless a check names its own) with the
    command, commit and machine on top."""
    folder = folder or RESULTS  # read at call time: tests point RESULTS at a scratch folder
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.md"
    path.write_text(f"{header(name, command)}\n{body.strip()}\n")
    return path


def plot_curves(
    path: Path,
    curves: dict[str, Sequence[float] | np.ndarray],
    *,
    title: str,
    xlabel: str = "round",
    ylabel: str = "test loss",
    logy: bool = False,
    bands: dict[str, np.ndarray] | None = None,
) -> Path | None:
    """Learning curves to a PNG (matplotlib, headless); ``bands`` gives ±spread per label."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ys in curves.items():
        ys = np.asarray(ys, dtype=float)
        xs = np.arange(1, len(ys) + 1)
        ax.plot(xs, ys, label=label)
        if bands and label in bands:
            ax.fill_between(xs, ys - bands[label], ys + bands[label], alpha=0.2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def study_parser(description: str, *, default_seeds: Sequence[int] = (0, 1, 2)) -> argparse.ArgumentParser:
    """The common flags: ``--quick``, ``--seeds``, ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small settings that finish in under a minute")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(default_seeds), help="random seeds")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/")
    return parser


class QueuedSession:
    """Just enough of ``MqttSession`` for ``MqttFleet`` with no broker: messages put in ``queue``
    come back from ``get`` (the in-process benchmarks and tests of the collecting thread)."""

    def __init__(self) -> None:
        from collections import deque

        self.queue: deque = deque()
        self.on_connect_hooks: list = []

    def subscribe(self, topic: str, qos: int = 1) -> None:
        pass

    def publish(self, topic, payload, retain=False, timeout=None) -> None:
        pass

    def get(self, timeout):
        return self.queue.popleft() if self.queue else None

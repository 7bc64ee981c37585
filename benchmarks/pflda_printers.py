"""PFL-DA Table 5: personalized speed models for six real Ender printers.

``python -m benchmarks.pflda_printers [--data ../shared/data/printers] [--seeds 0 1 2 3 4] [--quick]``

The authors' protocol (``printer_dataset/printer.py``; the data README): per printer,
input σ_a = sqrt(σ_ax² + σ_ay²) and target s/50, the Speed30 files as the test set and
the other eleven speeds for training (14 rows a file: their loader drops the first);
Adam lr 3e-3, weight decay 3e-4, fresh every round, 10 full-batch inner steps, lr × 0.99
every 5 rounds (× 0.9 for the NN), 200 rounds for the GLMs and 20 for the NN; uniform
server mean; the reported loss is 50·MSE(s/50) over all test points of every printer's
own personal model.  PFL-DA and Ditto pull the personal decoder after every inner step,
γ ← 0.9·w + 0.1·γ (the convex pull); Ditto also pulls its copy of the global encoder.

Our extra method, ``PFL-DA+CV``, keeps PFL-DA's algorithm and chooses, per model and
without the Speed30 data, one setting from a small declared grid by leave-one-speed-out
cross-validation on the eleven training speeds (see ``CANDIDATES``).

Every seed of a method runs in one vectorized fleet (:class:`benchmarks.pflda_sine.StackedFleet`,
replica mode): the same client and server code, with a leading replica axis on every array.
"""

from __future__ import annotations

import os

# One BLAS thread per process: these small stacked GEMMs get slower, not faster, with more.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.pflda_sine import (
    Block,
    StackedDataset,
    StackedFleet,
    keep_freed_memory,
    run_stacked,
)
from benchmarks.study_models import register_study_models
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

# The stacked printer models are named in the study's task specs (benchmarks.study_models).
register_study_models()

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "printers"
TEST_SPEED = 30


@dataclass(frozen=True)
class ModelSetup:
    """One row of Table 5: which model, and the authors' schedule for it."""

    label: str
    project_model: str
    stacked_model: str
    rounds: int
    lr_decay: float
    feature_center: float


MODELS = {
    "sigmoid": ModelSetup("Sigmoid GLM", "sigmoid_glm", "printer_sigmoid_stacked", 200, 0.99, 0.0),
    "gaussian": ModelSetup("Gaussian GLM", "gaussian_glm", "printer_gaussian_stacked", 200, 0.99, 0.0),
    "nn": ModelSetup("Neural network", "printer_nn", "printer_nn_stacked", 20, 0.9, 0.01),
}

#: Table 5 of the paper (test loss, mean ± std over 3 runs).
PAPER = {
    "sigmoid": {"ditto": (0.28, 0.02), "indiv": (0.268, 0.01), "pflda": (0.23, 0.01)},
    "gaussian": {"ditto": (0.26, 0.04), "indiv": (0.25, 0.01), "pflda": (0.25, 0.01)},
    "nn": {"ditto": (0.48, 0.04), "indiv": (0.25, 0.02), "pflda": (0.23, 0.02)},
}
#: The authors' code on a 2-core CPU over 5 seeds (the data README): last round.
AUTHORS = {
    "sigmoid": {"ditto": (0.290, 0.063), "indiv": (0.267, 0.006), "pflda": (0.229, 0.018)},
    "gaussian": {"ditto": (0.275, 0.108), "indiv": (0.232, 0.035), "pflda": (0.272, 0.033)},
    "nn": {"ditto": (0.343, 0.078), "indiv": (0.618, 0.318), "pflda": (0.311, 0.183)},
}
#: ... and for the NN the mean over its last 10 rounds.
AUTHORS_LAST10 = {"nn": {"ditto": (0.22, 0.03), "indiv": (0.49, 0.06), "pflda": (0.19, 0.08)}}

#: Ditto's sigmoid-GLM figure is bimodal over seeds (benchmarks/results/ditto_table5.md), so the
#: study also runs it over this many seeds (one stacked fleet, ~15 s) and reports the whole spread.
SPREAD_SEEDS = 50
#: A Ditto seed whose final test loss exceeds this is "far off" (the others end at 0.06-0.42).
FAR_OFF = 0.5
#: The authors' printer.py (CPU, Ditto, sigmoid) over its own torch seeds, measured for the Ditto diagnosis
#: (benchmarks/results/ditto_table5.md): seeds, far-off seeds, final losses' mean, sd, median.
AUTHORS_SPREAD = {"seeds": 30, "far_off": (12, 15), "mean": 0.291, "sd": 0.291, "median": 0.232}

BASELINES = ("pflda", "indiv", "ditto")
OTHERS = ("simple_da", "fedper", "tp")
LABELS = {
    "pflda": "PFL-DA",
    "indiv": "indiv",
    "ditto": "Ditto",
    "simple_da": "Simple-DA",
    "lgfedavg": "LG-FedAvg",
    "fedper": "FedPer",
    "tp": "TP",
    "best": "PFL-DA+CV",
}


# ---------------------------------------------------------------------------
# Data and runs.
# ---------------------------------------------------------------------------


def load_runs(root: str | Path) -> dict[int, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """``{printer: {speed: (x, y)}}`` with x = σ_a and y = s/50, first row of each file dropped."""
    from sensors.layers import to_xy
    from sensors.printer_data import load_printer_runs

    runs = load_printer_runs(root, drop_first_row=True)
    return {p: {s: to_xy(t) for s, t in sorted(by.items())} for p, by in sorted(runs.items())}


Split = tuple[tuple[int, ...], tuple[int, ...]]


def test_split(runs: dict) -> Split:
    """Table 5's split: every speed but 30 to train, 30 to test."""
    speeds = sorted(next(iter(runs.values())))
    return tuple(s for s in speeds if s != TEST_SPEED), (TEST_SPEED,)


def cv_splits(runs: dict) -> list[Split]:
    """Leave one training speed out, over the eleven training speeds (the Speed30 files never appear)."""
    train, _ = test_split(runs)
    return [(tuple(s for s in train if s != v), (v,)) for v in train]


def replica_blocks(runs: dict, splits: Sequence[Split], n_seeds: int, dtype: str) -> dict[str, Block]:
    """One block per printer; replica ``k·n_seeds + j`` holds split ``k`` (seed ``j``)."""
    blocks = {}
    for p, by in runs.items():

        def stack(speeds_of: int, by=by) -> StackedDataset:
            xs, ys = [], []
            for split in splits:
                speeds = split[speeds_of]
                x = np.concatenate([by[s][0] for s in speeds])
                y = np.concatenate([by[s][1] for s in speeds])
                xs += [x] * n_seeds
                ys += [y] * n_seeds
            return StackedDataset(np.stack(xs).astype(dtype), np.stack(ys).astype(dtype))

        blocks[f"printer{p}"] = Block((f"printer{p}",), stack(0), stack(1))
    return blocks


def method_spec(model: str, method: str, seed: int, rounds: int | None = None, **extra: Any) -> TaskSpec:
    """The authors' settings for ``method`` on ``model`` (see the module docstring)."""
    m = MODELS[model]
    hp: dict[str, Any] = {
        "lr": 3e-3,
        "weight_decay": 3e-4,
        "local_steps": 10,
        "lr_decay": m.lr_decay,
        "lr_decay_every": 5,
        "loss": "stacked_mse",
    }
    if method == "pflda":
        hp.update(lam=0.9, pull="convex", pull_at="every", feature_center=m.feature_center)
    elif method == "ditto":
        hp.update(
            lam=0.9,
            pull="convex",
            personal_pull=["decoder"],
            global_pull=["encoder"],
            feature_center=m.feature_center,
        )
    elif method == "simple_da":
        hp.update(feature_center=m.feature_center)
    elif method not in ("indiv", "lgfedavg", "fedper", "tp"):
        raise ValueError(f"unknown method {method!r}")
    hp.update(extra)
    return TaskSpec(
        name=f"printers-{model}-{method}",
        algorithm=method,
        model=m.stacked_model,
        hparams=hp,
        server={"weighting": "uniform"},
        dtype="float32",
        rounds=rounds or m.rounds,
        seed=seed,
    )


@dataclass
class Trace:
    """Personal-model predictions after every round: ``pred[t, printer, replica, point]``, targets alike."""

    pred: np.ndarray
    target: np.ndarray
    seconds: float

    def loss(self, ensemble_last: int = 1) -> np.ndarray:
        """``[round, replica]`` test loss 50·MSE(s/50); ``ensemble_last > 1`` averages the
        predictions of the last that many rounds first (a snapshot ensemble)."""
        pred = self.pred
        if ensemble_last > 1:
            c = np.cumsum(pred, axis=0, dtype=np.float64)
            c[ensemble_last:] = c[ensemble_last:] - c[:-ensemble_last]
            k = np.minimum(np.arange(1, len(pred) + 1), ensemble_last)
            pred = c / k[:, None, None, None]
        return 50.0 * np.mean((pred - self.target[None]) ** 2, axis=(1, 3))


def run_replicas(
    runs: dict,
    model: str,
    method: str,
    splits: Sequence[Split],
    seeds: Sequence[int],
    *,
    rounds: int | None = None,
    **extra: Any,
) -> Trace:
    """Every (split, seed) pair as one replica of a stacked fleet; predictions on each split's held-out speeds."""
    spec = method_spec(model, method, seeds[0], rounds, **extra)
    blocks = replica_blocks(runs, splits, len(seeds), spec.dtype)
    fleet = StackedFleet(spec, blocks, replicas=[s for _ in splits for s in seeds])
    preds: list[np.ndarray] = []
    start = time.perf_counter()

    def on_round(rec, global_params: Params) -> None:
        preds.append(
            np.stack([fleet.predict(global_params, b, blk.test.x)[..., 0] for b, blk in blocks.items()])
        )

    run_stacked(spec, fleet, on_round)
    target = np.stack([blk.test.y[..., 0] for blk in blocks.values()])
    return Trace(np.stack(preds), target, time.perf_counter() - start)


# ---------------------------------------------------------------------------
# PFL-DA+CV: PFL-DA with a declared grid chosen by leave-one-speed-out validation.
# ---------------------------------------------------------------------------

#: λ1 candidates per model (the NN's CV is the costliest, so it validates the authors' λ1 only).
LAMBDAS = {"sigmoid": (0.9, 0.5, 0.1), "gaussian": (0.9, 0.5, 0.1), "nn": (0.9,)}
#: Snapshot ensembles: the device averages the predictions of its last K personal models.
SNAPSHOTS = (1, 5, 10)
#: Independent PFL-DA fleets whose personal predictions each device averages (fixed, not tuned).
FLEETS = 3


def interior_cv_splits(runs: dict) -> list[Split]:
    """Leave out one *interior* training speed (20, 40, …, 110), train on the other ten.

    The question Table 5 asks is a prediction at an unmeasured speed setting inside
    the measured range, so the extremes (10 and 120, pure extrapolation) are not
    validation targets.  The Speed30 files are never used.
    """
    train, _ = test_split(runs)
    return [(tuple(s for s in train if s != v), (v,)) for v in train[1:-1]]


def select(traces: dict[float, Trace], n_folds: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """The (λ1, K) with the lowest mean validation loss; returns it and the whole grid's scores."""
    scores = []
    for lam, tr in traces.items():
        for k in SNAPSHOTS:
            scores.append([lam, k, float(tr.loss(k)[-1].mean())])
    lam, k, score = min(scores, key=lambda r: r[2])
    return {"lam": lam, "snapshots": k, "cv": score, "folds": n_folds}, scores


def ensemble_trace(tr: Trace, fleets: int) -> Trace:
    """Average the personal predictions of ``fleets`` consecutive replicas (one ensemble each)."""
    t, p, r, n = tr.pred.shape
    pred = tr.pred.reshape(t, p, r // fleets, fleets, n).mean(axis=3)
    target = tr.target.reshape(p, r // fleets, fleets, n)[:, :, 0]
    return Trace(pred, target, tr.seconds)


# ---------------------------------------------------------------------------
# The study.
# ---------------------------------------------------------------------------


def _job(args: tuple) -> tuple[tuple, Trace]:
    key, runs, model, method, splits, seeds, extra = args
    return key, run_replicas(runs, model, method, splits, seeds, **extra)


def _run_jobs(jobs: list[tuple], workers: int, desc: str) -> dict[tuple, Trace]:
    from benchmarks.common import progress

    if workers <= 1:
        return dict(_job(j) for j in progress(jobs, desc))
    import multiprocessing as mp

    with mp.get_context("fork").Pool(workers) as pool:
        return dict(progress(pool.imap_unordered(_job, jobs), desc, total=len(jobs)))


#: Rough relative cost of a replica-round, to start the longest jobs first.
_COST = {"sigmoid": 1.0, "gaussian": 4.0, "nn": 25.0}


def run_study(
    runs: dict,
    models: Sequence[str],
    methods: Sequence[str],
    seeds: Sequence[int],
    *,
    cv_seeds: Sequence[int] = (0,),
    best: bool = True,
    workers: int = 2,
    spread_seeds: Sequence[int] = (),
) -> dict[str, Any]:
    """All test runs, the cross-validation and PFL-DA+CV's test runs; returns traces and choices.

    ``spread_seeds``: also run the sigmoid GLM's Ditto over these seeds (``out["spread"]``).
    """
    test = [test_split(runs)]
    folds = interior_cv_splits(runs)
    jobs = [(("test", m, meth), runs, m, meth, test, list(seeds), {}) for m in models for meth in methods]
    if spread_seeds and "sigmoid" in models and "ditto" in methods:
        jobs.append((("spread", "sigmoid", "ditto"), runs, "sigmoid", "ditto", test, list(spread_seeds), {}))
    if best:
        jobs += [
            (("cv", m, lam), runs, m, "pflda", folds, list(cv_seeds), {"lam": lam})
            for m in models
            for lam in LAMBDAS[m]
        ]

    def cost(j: tuple) -> float:
        return _COST[j[2]] * len(j[4]) * len(j[5]) * MODELS[j[2]].rounds

    traces = _run_jobs(sorted(jobs, key=cost, reverse=True), workers, "printer runs")
    out: dict[str, Any] = {"test": {}, "choice": {}, "grid": {}, "best": {}, "spread": None}
    for (kind, m, meth), tr in traces.items():
        if kind == "test":
            out["test"][(m, meth)] = tr
        elif kind == "spread":
            out["spread"] = (list(spread_seeds), tr.loss()[-1])
    if best:
        for m in models:
            choice, grid = select({lam: traces[("cv", m, lam)] for lam in LAMBDAS[m]}, len(folds))
            out["choice"][m], out["grid"][m] = choice, grid
        ens_seeds = [s + 1000 * f for s in seeds for f in range(FLEETS)]
        jobs = [
            (("best", m, "pflda"), runs, m, "pflda", test, ens_seeds, {"lam": out["choice"][m]["lam"]})
            for m in models
        ]
        for (_, m, _), tr in _run_jobs(jobs, workers, "PFL-DA+CV runs").items():
            out["best"][m] = ensemble_trace(tr, FLEETS)
    return out


def quick(root: str | Path, seeds: Sequence[int] = (0, 1, 2)) -> dict[str, float]:
    """``--quick``: the sigmoid GLM, PFL-DA vs indiv vs Ditto, full schedule; mean final test loss."""
    runs = load_runs(root)
    out = {}
    for method in ("pflda", "indiv", "ditto"):
        tr = run_replicas(runs, "sigmoid", method, [test_split(runs)], list(seeds))
        out[method] = float(tr.loss()[-1].mean())
    return out


def spread_line(seeds: Sequence[int], final: np.ndarray) -> str:
    """Ditto's sigmoid-GLM final loss over many seeds beside the authors' code's, one line."""
    far = [s for s, v in zip(seeds, final, strict=True) if v > FAR_OFF]
    a = AUTHORS_SPREAD
    sd = final.std(ddof=1) if len(final) > 1 else 0.0
    return (
        f"- Ditto over {len(seeds)} seeds ({seeds[0]}-{seeds[-1]}): {final.mean():.3f} ± {sd:.3f}, median "
        f"{np.median(final):.3f}; far off (> {FAR_OFF}): {len(far)}/{len(seeds)} (seeds {far}).  The authors' code "
        f"over its own torch seeds 0-{a['seeds'] - 1}: {a['mean']:.3f} ± {a['sd']:.3f}, median {a['median']:.3f}; "
        f"far off: {len(a['far_off'])}/{a['seeds']} (seeds {list(a['far_off'])}).  Same start, same trajectory: "
        "see benchmarks/results/ditto_table5.md."
    )


def _fmt(pair: tuple[float, float] | None) -> str:
    return "—" if pair is None else f"{pair[0]:.3g} ± {pair[1]:.2g}"


def summarize(out: dict[str, Any], models: Sequence[str], methods: Sequence[str], n_seeds: int) -> str:
    """Per-model results tables beside the paper's and the authors'-code figures, and the CV choice."""
    from benchmarks.common import fmt_mean_std, markdown_table

    parts = []
    for m in models:
        rounds = MODELS[m].rounds
        rows = []
        means = {}
        entries = [(meth, out["test"][(m, meth)]) for meth in methods if (m, meth) in out["test"]]
        if m in out["best"]:
            entries.append(("best", out["best"][m]))
        means10 = {}
        for meth, tr in entries:
            loss = tr.loss(out["choice"][m]["snapshots"] if meth == "best" else 1)
            final, last10 = loss[-1], loss[-10:].mean(axis=0)
            means[meth], means10[meth] = float(final.mean()), float(last10.mean())
            rows.append(
                [
                    LABELS[meth],
                    fmt_mean_std(final, 3),
                    f"{np.median(final):.3f}",
                    fmt_mean_std(last10, 3),
                    _fmt(AUTHORS[m].get(meth)),
                    _fmt(AUTHORS_LAST10.get(m, {}).get(meth)),
                    _fmt(PAPER[m].get(meth)),
                ]
            )
        headers = [
            "method",
            f"ours: round {rounds} (mean ± std, {n_seeds} seeds)",
            "median",
            "ours: mean of last 10 rounds",
            "authors' code, last round",
            "authors' code, last 10 rounds",
            "paper (Table 5)",
        ]
        figures = [v[0] for v in PAPER[m].values()] + [v[0] for v in AUTHORS[m].values()]
        best_meth = min(means, key=means.get)
        lines = [f"### {MODELS[m].label}", "", markdown_table(headers, rows), ""]
        if "pflda" in means:
            ref, sd = AUTHORS[m]["pflda"]
            ok = abs(means["pflda"] - ref) <= sd
            lines.append(
                f"- PFL-DA reproduction: ours {means['pflda']:.3f} vs the authors' code {ref:.3f} ± {sd:.3f}: "
                f"{'within' if ok else 'outside'} one of their standard deviations."
            )
        if m in AUTHORS_LAST10:
            low10 = min(v[0] for v in AUTHORS_LAST10[m].values())
            b10 = min(means10, key=means10.get)
            ours = f"ours {LABELS[b10]} {means10[b10]:.3f}"
            if b10 != "pflda":  # name PFL-DA beside the lowest, not twice when it is the lowest
                ours += f", PFL-DA {means10.get('pflda', float('nan')):.3f}"
            lines.append(f"- Mean of the last 10 rounds: the authors' lowest {low10:.3f}; {ours}.")
        low = min(figures)
        lines.append(
            f"- Lowest last-round figure in the issue/README for this model: {low:.3f}.  Our lowest mean (a row chosen "
            f"by its test score): {LABELS[best_meth]} {means[best_meth]:.3f} "
            f"({'below' if means[best_meth] < low else 'not below'} it)."
        )
        if "best" in means:
            lines.append(
                f"- PFL-DA+CV (chosen without the Speed30 data): {means['best']:.3f}, "
                f"{'below' if means['best'] < low else 'not below'} the lowest figure."
            )
        if m == "sigmoid" and out.get("spread") is not None:
            lines.append(spread_line(*out["spread"]))
        if m in out["choice"]:
            c = out["choice"][m]
            grid = ", ".join(f"λ1={lam:g}/K={k}: {s:.3f}" for lam, k, s in out["grid"][m])
            lines.append(
                f"- PFL-DA+CV chose λ1 = {c['lam']:g} and a {c['snapshots']}-round snapshot ensemble "
                f"(validation loss {c['cv']:.3f} over {c['folds']} held-out interior speeds; grid: {grid}); "
                f"each device averages {FLEETS} independent fleets."
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


NOTES = """\
## Protocol

Exactly the authors' (`printer_dataset/printer.py`), on the published files: input σ_a, target s/50;
test = the Speed30 files, train = the other eleven speeds, 14 rows a file (their loader drops the
first); Adam lr 3e-3, weight decay 3e-4, a fresh optimizer every round, 10 full-batch inner steps,
lr × 0.99 every 5 rounds (× 0.9 for the NN), 200 rounds (GLMs) / 20 (NN); uniform server mean; test
loss 50·MSE(s/50) over every test point, each printer scored with its own personal model, at the
last round.  Models: the authors' `Encoder_sigmoid`/`Decoder_sigmoid`, `Encoder_kernel`/
`Decoder_kernel` (16 bumps, 16 → 1024 → 1; computed through W1·W2, the same function and
gradients) and `Encoder`/`Decoder` (128-wide), with their NN feature-centring term 0.01.

- **PFL-DA**: convex pull γ ← 0.9·w + 0.1·γ after every inner step (the authors' code; the
  gradient form of Algorithm 3 is available as `pull="gradient"` but not used in these tables).
- **Ditto**: the authors' baseline — the personal decoder is pulled toward the global decoder after
  every inner step and the device's copy of the global *encoder* toward the global encoder; the
  personal encoder is free.  So the global encoder stays at its random draw (it moves < 0.06 in
  200 rounds), every personal decoder stays within 0.01 of the global decoder, and that decoder
  w1·σ(h) + w2 is fitted through a fixed random feature h = a0·x + b0.  A personal model can only
  follow it, and a seed ends far off (sigmoid GLM) when w1 changes sign late (after round ~100:
  each printer's encoder must then reverse its slope at Adam's pace and runs out of rounds; our
  seeds 2, 11, 33) or when a0 ≈ 0, so that w1 is never fitted and the pinned decoder's output
  range misses the speeds (seed 1: [0.60, 0.96] against targets 0.20–0.88).  The authors' code,
  started from our seed-1 and seed-2 parameters, follows the same trajectories to the same losses,
  so it does not avoid this: its own seeds 0–4 (0.290 ± 0.063) drew no such start (their seed 0,
  0.403, is a milder a0 ≈ 0 case) and ours drew two.  The line under the sigmoid table gives Ditto
  over many seeds beside the authors' code's; benchmarks/results/ditto_table5.md has the evidence.
- **indiv**: each printer alone, same schedule.
- **Simple-DA** (personal encoder, shared decoder; on these models identical to LG-FedAvg),
  **FedPer** (shared encoder, personal decoder) and **TP** (FedAvg, then each device fine-tunes the
  latest global for 10 steps every round): our baselines with the same schedule, untuned.
- **PFL-DA+CV**: PFL-DA whose λ1 and snapshot-ensemble length K are chosen by leave-one-speed-out
  validation over the nine interior training speeds (never the Speed30 files), with each device
  averaging the personal predictions of {fleets} independently initialised fleets (fixed, not tuned).

Repeated runs of the same seeds agree to rounding for the GLMs but not for the NN: float32 GEMMs
round differently with memory alignment, and 20 rounds of a 128-wide net amplify that, so its
figures move by a few hundredths from run to run; the spread over seeds is the error bar to read.

Choosing the lowest row of a table by its test score is itself a mild selection on the test set;
the only method here whose settings were chosen without the Speed30 data is PFL-DA+CV (the others
run the authors' settings unchanged).
"""


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.common import RESULTS, plot_curves, study_parser, write_result

    parser = study_parser(__doc__.split("\n\n")[0], default_seeds=range(5))
    parser.add_argument(
        "--data", default=str(DEFAULT_DATA), help="folder with FL_Dataset_Printer*_Speed*.csv"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--methods", nargs="+", default=list(BASELINES + OTHERS), choices=list(BASELINES + OTHERS)
    )
    parser.add_argument("--no-cv", action="store_true", help="skip PFL-DA+CV")
    parser.add_argument("--cv-seeds", type=int, nargs="+", default=[0], help="seeds of the validation runs")
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    parser.add_argument(
        "--spread-seeds",
        type=int,
        default=SPREAD_SEEDS,
        help=f"also run the sigmoid GLM's Ditto over seeds 0..N-1 (default {SPREAD_SEEDS}; 0: skip)",
    )
    args = parser.parse_args(argv)
    keep_freed_memory()
    try:
        runs = load_runs(args.data)
    except FileNotFoundError as exc:
        parser.exit(2, f"{exc}\nGet the six-printer CSVs (Zenodo 10.5281/zenodo.5747732) into {args.data}\n")
    if args.quick:
        result = quick(args.data, args.seeds[:3])
        print(" | ".join(f"{LABELS[k]} {v:.3f}" for k, v in result.items()) + "  (sigmoid GLM, final round)")
        return 0
    start = time.perf_counter()
    out = run_study(
        runs,
        args.models,
        args.methods,
        args.seeds,
        cv_seeds=args.cv_seeds,
        best=not args.no_cv,
        workers=args.workers,
        spread_seeds=range(args.spread_seeds),
    )
    seconds = time.perf_counter() - start
    body = summarize(out, args.models, args.methods, len(args.seeds))
    body += (
        f"\n\n{len(args.seeds)} seeds; wall-clock {seconds:.0f} s with {args.workers} processes "
        f"(1-minute load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)."
    )
    print(body)
    if not args.no_write:
        figs = []
        for m in args.models:
            curves, bands = {}, {}
            for meth in args.methods:
                if (m, meth) in out["test"]:
                    loss = out["test"][(m, meth)].loss()
                    curves[LABELS[meth]], bands[LABELS[meth]] = loss.mean(axis=1), loss.std(axis=1)
            if m in out["best"]:
                loss = out["best"][m].loss(out["choice"][m]["snapshots"])
                curves[LABELS["best"]], bands[LABELS["best"]] = loss.mean(axis=1), loss.std(axis=1)
            png = plot_curves(
                RESULTS / f"pflda_printers_{m}.png",
                curves,
                bands=bands,
                title=f"Printers, {MODELS[m].label}: test loss 50·MSE(s/50), mean ± std over seeds",
                logy=True,
            )
            if png:
                figs.append(f"![{MODELS[m].label}]({png.name})")
        write_result("pflda_printers", body + "\n\n" + NOTES.format(fleets=FLEETS) + "\n" + "\n".join(figs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

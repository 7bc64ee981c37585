"""FedDAR §5.1: domain-mixed linear regression over 100 clients.

``python -m benchmarks.feddar_synthetic [--quick] [--seeds 0 1 2] [--samples 5 10 20] [--alpha 0.4]``
``python -m benchmarks.feddar_synthetic --alpha-sweep [--alphas 0.1 0.5 1 100] [--samples 10]``

The data (the paper's §5.1 and App. B.3.1): ground truth ``B* ∈ R^{d×k}`` and
``W* ∈ R^{M×k}`` are the Q factors of i.i.d. standard normal matrices; client
``i`` draws ``π_i ~ Dir(α·p)`` with ``p`` uniform, then each of its ``L``
training samples draws a domain ``z ~ π_i``, ``x ~ N(0, I_d)`` and
``y = w*_zᵀ B*ᵀ x + σ·ε``.  Test samples (``n_test`` per client, same ``π_i``) are
noise-free.  n = 100, M = 5, k = 2, d = 20, σ = 1e-3, α = 0.4; the same ``L``
samples serve every round.

Every method trains the same model, ``linear_rep`` (``xᵀ B w``: a bias-free
``d → k`` encoder and ``k → 1`` head, drawn at random as in App. B.3.1), with
full-batch SGD and the same budget per round (:class:`StudyConfig`); the score
is the mean over clients of the test MSE of the model each client predicts
with, after the last round:

- Local-only (``indiv``): every client alone.
- FedAvg: one model.
- FedRep: shared encoder, one head per client (τ_h head steps, then τ_φ encoder steps).
- Separate FedAvg: one FedAvg model per domain, each trained on that domain's samples.
- FedDAR-WA / FedDAR-SA: shared encoder, one head per domain (Algorithm 1), heads
  averaged by counts (WA) or by second-order aggregation (SA, eq. 8).
- FedDAR-Alg2 (extra): Algorithm 2, exact head solve at the server, one encoder
  step, QR.

Runs are independent, so they spread over ``--workers`` processes; each run is
the ordinary client and server code under the one ``RoundEngine``
(``cloud_aggregator.rounds.simulation.simulate``).
"""

from __future__ import annotations

import os

# One BLAS thread per worker: these matrices are tiny and the workers fill the cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import logging
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, markdown_table, progress, study_parser, write_result
from cloud_aggregator.rounds.simulation import ClientData, simulate
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

BASELINES = ("Local-only", "FedAvg", "FedRep", "Separate FedAvg")
FEDDAR = ("FedDAR-WA", "FedDAR-SA")
EXTRA = ("FedDAR-Alg2",)
METHODS = BASELINES + FEDDAR + EXTRA
# The paper reports §5.1 only as a log-scale figure (Fig. 1, no table): these are its words.
PAPER_FIG1 = {
    "FedDAR-SA": "four orders of magnitude below every baseline, at 5, 10 and 20 samples",
    "FedDAR-WA": "fails to converge in this setting",
}
# Its robustness-to-α evidence is FairFace age classification (Table 1, average accuracy %
# over the 7 domains at α = 0.1 / 0.5 / 1 / 100); it has no synthetic α sweep.
PAPER_TABLE1 = {
    "FedAvg": "40.0 / 41.6 / 41.1 / 40.8",
    "Separate FedAvg": "19.3 / 23.5 / 23.4 / 22.9",
    "FedDAR-WA": "40.5 / 42.9 / 42.7 / 42.5",
    "FedDAR-SA": "42.4 / 43.4 / 43.7 / 43.6 (stable)",
}
TARGET_RATIO = 1e4


@dataclass(frozen=True)
class StudyConfig:
    """The synthetic problem and the training budget.

    Every federated method takes ``steps`` (τ, τ_φ) full-batch SGD steps of size ``lr``
    on its shared part per round; with the default τ = 1 the averaged step is one
    gradient step on the pooled objective, which is stable at ``lr`` for every
    method (several local steps on five samples in 20 dimensions are not; see
    the results notes).  Heads (FedRep, FedDAR) take ``head_steps`` (τ_h) steps of
    ``head_lr``.  Local-only has no pooled objective: its step must suit one
    client's data, so it takes ``local_steps`` steps of ``local_lr`` per round.
    ``alg2_lr`` is Algorithm 2's server step η.
    """

    n_clients: int = 100
    n_domains: int = 5
    k: int = 2
    d: int = 20
    sigma: float = 1e-3
    n_test: int = 100
    rounds: int = 100
    lr: float = 0.25
    steps: int = 1
    head_lr: float = 0.1
    head_steps: int = 5
    local_lr: float = 0.05
    local_steps: int = 5
    alg2_lr: float = 0.5
    eval_every: int = 5
    rare: float | None = None

    def prior(self) -> np.ndarray:
        """``p``: uniform, or the last domain with mass ``rare`` and the rest shared equally."""
        if self.rare is None:
            return np.full(self.n_domains, 1.0 / self.n_domains)
        if not 0.0 < self.rare < 1.0:
            raise ValueError(f"rare must be in (0, 1), got {self.rare}")
        p = np.full(self.n_domains, (1.0 - self.rare) / (self.n_domains - 1))
        p[-1] = self.rare
        return p


@dataclass(frozen=True)
class Job:
    method: str
    samples: int
    alpha: float
    seed: int
    cfg: StudyConfig = field(default_factory=StudyConfig)


@dataclass
class RunResult:
    """One run's learning curve (mean client test MSE after the rounds in ``rounds``)."""

    job: Job
    rounds: list[int]
    mse: list[float]
    seconds: float
    rejected: int

    @property
    def final(self) -> float:
        return self.mse[-1]


def synthetic_fleet(
    cfg: StudyConfig, samples: int, alpha: float, seed: int
) -> tuple[dict[str, ClientData], dict[str, Dataset], dict[str, np.ndarray]]:
    """The §5.1 fleet: ``(train clients, noise-free test sets, ground truth {"B", "W", "pi"})``."""
    rng = np.random.default_rng(seed)
    b, _ = np.linalg.qr(rng.standard_normal((cfg.d, cfg.k)))
    w, _ = np.linalg.qr(rng.standard_normal((cfg.n_domains, cfg.k)))
    pis = rng.dirichlet(alpha * cfg.prior(), size=cfg.n_clients)

    def draw(pi: np.ndarray, n: int, noise: float) -> Dataset:
        z = rng.choice(cfg.n_domains, size=n, p=pi / pi.sum())
        x = rng.standard_normal((n, cfg.d))
        y = np.einsum("nd,dk,nk->n", x, b, w[z]) + noise * rng.standard_normal(n)
        return Dataset(x, y[:, None], z)

    clients, tests = {}, {}
    for i, pi in enumerate(pis):
        name = f"c{i:03d}"
        clients[name] = ClientData(draw(pi, samples, cfg.sigma))
        tests[name] = draw(pi, cfg.n_test, 0.0)
    return clients, tests, {"B": b, "W": w, "pi": pis}


def task_spec(method: str, cfg: StudyConfig, seed: int) -> TaskSpec:
    """The task each method runs (one model, one budget; see the module docstring)."""
    sgd = {"optimizer": "sgd", "lr": cfg.lr, "local_steps": cfg.steps}
    heads = {"head_steps": cfg.head_steps, "head_lr": cfg.head_lr}
    local = {"optimizer": "sgd", "lr": cfg.local_lr, "local_steps": cfg.local_steps}
    m = cfg.n_domains
    table: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
        "Local-only": ("indiv", local, {}),
        "FedAvg": ("fedavg", sgd, {}),
        "FedRep": ("fedrep", {**sgd, **heads}, {}),
        "Separate FedAvg": ("separate_fedavg", {**sgd, "n_domains": m}, {}),
        "FedDAR-WA": ("feddar", {**sgd, **heads, "n_domains": m, "aggregation": "wa"}, {}),
        "FedDAR-SA": ("feddar", {**sgd, **heads, "n_domains": m, "aggregation": "sa"}, {}),
        "FedDAR-Alg2": ("feddar_linear", {"n_domains": m}, {"lr": cfg.alg2_lr}),
    }
    try:
        algorithm, hparams, server = table[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}") from None
    return TaskSpec(
        name="feddar-synthetic",
        algorithm=algorithm,
        model="linear_rep",
        model_args={"d_in": cfg.d, "k": cfg.k, "d_out": 1},
        hparams=hparams,
        server=server,
        dtype="float64",
        rounds=cfg.rounds,
        seed=seed,
    )


def run_job(job: Job) -> RunResult:
    """Train one method on one fleet; the curve is sampled every ``eval_every`` rounds and at the end."""
    logging.getLogger("cloud_aggregator").setLevel(logging.ERROR)
    cfg = job.cfg
    clients, tests, _ = synthetic_fleet(cfg, job.samples, job.alpha, job.seed)
    spec = task_spec(job.method, cfg, job.seed)
    rounds: list[int] = []
    mse: list[float] = []
    rejected = 0

    def on_record(rec, fleet, global_params) -> None:
        nonlocal rejected
        rejected += len(rec.rejected)
        if rec.phase != fleet.algo.phases()[-1]:
            return
        if rec.round % cfg.eval_every and rec.round != cfg.rounds:
            return
        with np.errstate(all="ignore"):
            losses = [fleet.algo.evaluate(global_params, fleet.local[d], tests[d])["loss"] for d in tests]
        rounds.append(rec.round)
        mse.append(float(np.mean(losses)))

    start = time.perf_counter()
    with np.errstate(over="ignore", invalid="ignore"):
        simulate(spec, clients, on_record=on_record)
    return RunResult(job, rounds, mse, time.perf_counter() - start, rejected)


def run_all(jobs: Sequence[Job], workers: int, desc: str) -> list[RunResult]:
    """Run ``jobs`` over ``workers`` processes (1: in this process), with a progress bar."""
    if workers <= 1:
        return [run_job(j) for j in progress(jobs, desc)]
    results = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_job, j) for j in jobs]
        for fut in progress(as_completed(futures), desc, total=len(futures)):
            results.append(fut.result())
    order = {j: i for i, j in enumerate(jobs)}
    return sorted(results, key=lambda r: order[r.job])


# -- reporting -------------------------------------------------------------------------


def sci(values: Sequence[float]) -> str:
    """``mean ± std`` in scientific notation; ``diverged`` when any run is not finite."""
    vals = np.asarray(values, dtype=float)
    if not np.isfinite(vals).all():
        return "diverged"
    std = vals.std(ddof=1) if len(vals) > 1 else 0.0
    return f"{vals.mean():.2e} ± {std:.1e}"


def finals(results: Sequence[RunResult], method: str, key: Callable[[Job], bool]) -> list[float]:
    return [r.final for r in results if r.job.method == method and key(r.job)]


def ratio_rows(
    results: Sequence[RunResult],
    methods: Sequence[str],
    columns: Sequence[tuple[str, Callable[[Job], bool]]],
    note: str = "≥ 1e4",
) -> tuple[list[list[str]], dict[str, dict[str, float]]]:
    """Rows "baseline ÷ FedDAR-SA" (means over seeds) and a verdict row; the ratios per column.

    A baseline that diverged counts as infinitely far above FedDAR-SA.
    """
    baselines = [m for m in methods if m in BASELINES]
    if "FedDAR-SA" not in methods or not baselines:
        return [], {}
    ratios: dict[str, dict[str, float]] = {}
    for label, key in columns:
        sa = float(np.mean(finals(results, "FedDAR-SA", key)))
        ratios[label] = {}
        for m in baselines:
            base = float(np.mean(finals(results, m, key)))
            ratios[label][m] = base / sa if np.isfinite(base) else float("inf")
    rows = [
        [f"{m} ÷ FedDAR-SA", *[f"{ratios[label][m]:.1e}" for label, _ in columns], note] for m in baselines
    ]
    verdict = [
        ("yes" if min(ratios[label].values()) >= TARGET_RATIO else "no")
        + f" (smallest {min(ratios[label].values()):.1e})"
        for label, _ in columns
    ]
    rows.append(["every baseline ≥ 1e4 × FedDAR-SA?", *verdict, note])
    return rows, ratios


def results_table(
    results: Sequence[RunResult],
    methods: Sequence[str],
    columns: Sequence[tuple[str, Callable[[Job], bool]]],
    *,
    alpha_sweep: bool = False,
) -> tuple[str, dict[str, dict[str, float]]]:
    """Mean ± std of the final MSE per method and column, the paper's words or figures beside them."""
    if alpha_sweep:
        paper, paper_head = PAPER_TABLE1, "paper: FairFace Table 1, avg accuracy % (α = 0.1 / 0.5 / 1 / 100)"
    else:
        paper, paper_head = PAPER_FIG1, "paper (§5.1, Fig. 1)"
    headers = ["method", *[c for c, _ in columns], paper_head]
    rows = [[m, *[sci(finals(results, m, key)) for _, key in columns], paper.get(m, "")] for m in methods]
    note = "(§5.1: ≥ 1e4 at α = 0.4)" if alpha_sweep else "≥ 1e4"
    extra, ratios = ratio_rows(results, methods, columns, note)
    return markdown_table(headers, rows + extra), ratios


def plot_panels(
    path: Path, panels: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]], title: str
) -> Path | None:
    """One log-scale learning-curve panel per setting: mean client test MSE over seeds per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (name, curves) in zip(axes[0], panels.items(), strict=True):
        for label, (xs, ys) in curves.items():
            ax.plot(xs, np.where(np.isfinite(ys), ys, np.nan), label=label)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean client test MSE")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def mean_curves(
    results: Sequence[RunResult], methods: Sequence[str], key: Callable[[Job], bool]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for m in methods:
        runs = [r for r in results if r.job.method == m and key(r.job)]
        if runs:
            out[m] = (np.asarray(runs[0].rounds), np.mean([r.mse for r in runs], axis=0))
    return out


def late_fall(results: Sequence[RunResult], method: str, key: Callable[[Job], bool], rounds: int) -> float:
    """How many times lower the mean curve ends than ``rounds`` earlier (1: converged)."""
    runs = [r for r in results if r.job.method == method and key(r.job)]
    if not runs:
        return float("nan")
    xs = np.asarray(runs[0].rounds)
    ys = np.mean([r.mse for r in runs], axis=0)
    earlier = int(np.searchsorted(xs, xs[-1] - rounds))
    return float(ys[earlier] / ys[-1])


def diagnosis_table(
    results: Sequence[RunResult],
    methods: Sequence[str],
    cfg: StudyConfig,
    sweep: Sequence[tuple[float, int]],
    seeds: Sequence[int],
    columns: Sequence[tuple[str, Callable[[Job], bool]]],
) -> str:
    """Why the per-domain baseline lands where it does: pooled samples per domain vs d, and convergence.

    A separate model per domain is a ``d``-dimensional regression, identifiable only
    when the domain's samples pooled over all clients reach ``d``; a FedDAR head needs ``k``.
    """
    window = min(20, cfg.rounds // 2)
    rows = []
    for (label, key), (alpha, samples) in zip(columns, sweep, strict=True):
        smallest = []
        for seed in seeds:
            clients, _, _ = synthetic_fleet(cfg, samples, alpha, seed)
            totals = np.sum(
                [np.bincount(c.train.domain, minlength=cfg.n_domains) for c in clients.values()], axis=0
            )
            smallest.append(int(totals.min()))
        falls = [
            f"×{late_fall(results, m, key, window):.1f}" if m in methods else "–"
            for m in ("Separate FedAvg", "FedDAR-SA")
        ]
        rows.append([label, f"{min(smallest)} / {np.mean(smallest):.0f}", *falls])
    headers = [
        "setting",
        f"smallest pooled domain sample count, min / mean over seeds (d = {cfg.d}, k = {cfg.k})",
        f"Separate FedAvg: MSE fall over the last {window} rounds",
        f"FedDAR-SA: MSE fall over the last {window} rounds",
    ]
    return markdown_table(headers, rows)


# -- the studies -----------------------------------------------------------------------


def parse(argv: Sequence[str] | None = None):
    parser = study_parser(__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=None, help="training samples per client L")
    parser.add_argument("--alpha", type=float, default=0.4, help="Dirichlet concentration α (sample study)")
    parser.add_argument(
        "--alpha-sweep", action="store_true", help="reproduction 4: sweep α instead of the sample size"
    )
    parser.add_argument(
        "--alphas", type=float, nargs="+", default=[0.1, 0.5, 1.0, 100.0], help="α of the sweep"
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, metavar="METHOD")
    parser.add_argument(
        "--rounds", type=int, default=None, help="communication rounds (default 100; quick 50)"
    )
    parser.add_argument("--lr", type=float, default=None, help="SGD step of whole-model and encoder steps")
    parser.add_argument("--head-lr", type=float, default=None, help="SGD step of head steps (FedRep, FedDAR)")
    parser.add_argument("--steps", type=int, default=None, help="local steps τ (τ_φ for FedRep and FedDAR)")
    parser.add_argument("--head-steps", type=int, default=None, help="head steps τ_h (FedRep, FedDAR)")
    parser.add_argument(
        "--rare",
        type=float,
        default=None,
        metavar="P",
        help="extra setting: prior mass P of the last domain (the rest uniform) instead of a uniform prior",
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    return parser.parse_args(argv)


VERDICT = """
Where this falls short of the paper (our reading of the committed runs of 2026-11-22; rerun, recheck).
With every domain equally likely (feddar_synthetic.md and the
α sweep), FedDAR-SA is 10^5-10^7 below Local-only, FedAvg and FedRep, as the paper says, but only
~10^2 (46-130×) below Separate FedAvg, so the 10^4 target is not met against that baseline: with
n = 100 clients every domain pools 61-296 samples, more than d = 20, so a separate linear model per
domain is identifiable and its error is still falling at the last round (×4-7 over the last 20
rounds in the diagnosis above) -- the gap is convergence speed, not a wall. With one rare domain
(`--rare 0.01`) that domain does not pool d samples at L = 5 and 10, every ratio shrinks at L = 5
(smallest 30×), and all reach 10^4 only at L = 20. FedDAR-WA converges here about as well as SA;
the paper's "fails to converge" is not reproduced. Our reading, not tested further: with noise-free
test data and nearly identical client heads after τ_h full-batch steps, their weighted mean is
already close to the optimum that SA's Hessian weighting finds.

"""


def quick_config() -> StudyConfig:
    return StudyConfig(rounds=50, eval_every=5)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    cfg = quick_config() if args.quick else StudyConfig()
    overrides = {"rounds": args.rounds, "lr": args.lr, "head_lr": args.head_lr, "steps": args.steps}
    overrides["head_steps"] = args.head_steps
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.rare is not None:
        cfg = replace(cfg, rare=args.rare)
    methods = list(args.methods)
    if args.quick and args.methods == list(METHODS):
        methods = ["Local-only", "FedAvg", "FedRep", "Separate FedAvg", "FedDAR-WA", "FedDAR-SA"]
    if args.alpha_sweep:
        samples = args.samples or [10]
        sweep = [(a, s) for a in args.alphas for s in samples]
        name = "feddar_alpha"
    else:
        samples = args.samples or ([10] if args.quick else [5, 10, 20])
        sweep = [(args.alpha, s) for s in samples]
        name = "feddar_synthetic"
    if args.rare is not None:
        name += "_rare"
    if args.quick:
        name += "_quick"
    jobs = [Job(m, s, a, seed, cfg) for a, s in sweep for seed in args.seeds for m in methods]
    start = time.perf_counter()
    results = run_all(jobs, args.workers, name)
    wall = time.perf_counter() - start

    columns = [
        (
            (f"α = {a:g}" if args.alpha_sweep else f"L = {s}")
            + (f", L = {s}" if args.alpha_sweep and len(samples) > 1 else ""),
            (lambda j, a=a, s=s: j.alpha == a and j.samples == s),
        )
        for a, s in sweep
    ]
    table, ratios = results_table(results, methods, columns, alpha_sweep=args.alpha_sweep)
    cpu = sum(r.seconds for r in results)
    setting = (
        f"n = {cfg.n_clients} clients, M = {cfg.n_domains}, k = {cfg.k}, d = {cfg.d}, σ = {cfg.sigma:g}, "
        + (f"L = {samples}" if args.alpha_sweep else f"α = {args.alpha:g}")
        + (
            f", prior p = {np.round(cfg.prior(), 3).tolist()} (one rare domain)"
            if cfg.rare is not None
            else ", uniform prior p"
        )
        + f", {cfg.n_test} noise-free test samples per client, seeds {list(args.seeds)}, {cfg.rounds} rounds; "
        f"full-batch SGD: shared parts {cfg.steps} step(s) of {cfg.lr} per round (τ = τ_φ), heads "
        f"τ_h = {cfg.head_steps} steps of {cfg.head_lr}, Local-only {cfg.local_steps} steps of {cfg.local_lr}, "
        f"Algorithm 2's η = {cfg.alg2_lr}."
    )
    per_run = ", ".join(
        f"{m} {np.mean([r.seconds for r in results if r.job.method == m]):.1f}" for m in methods
    )
    body = (
        f"{setting}\n\nMean client test MSE after the last round, mean ± std over seeds.\n\n{table}\n\n"
        f"Wall time {wall:.0f} s on {args.workers} worker(s) ({cpu:.0f} s of runs; seconds per run: "
        f"{per_run}); rejected uploads: {sum(r.rejected for r in results)}.\n"
    )
    if args.alpha_sweep and "FedDAR-SA" in methods:
        sa = [float(np.mean(finals(results, "FedDAR-SA", key))) for _, key in columns]
        body += f"FedDAR-SA across the sweep: largest ÷ smallest mean MSE = {max(sa) / min(sa):.2f}.\n"
    body += (
        "\nDiagnosis. A separate model per domain is a d-dimensional regression, identifiable once the "
        "domain's samples pooled over all clients reach d; a FedDAR head needs only k of them (the remark "
        "after the paper's Theorem 4.1). A fall near ×1 means the curve has flattened by the last round.\n\n"
        + diagnosis_table(results, methods, cfg, sweep, args.seeds, columns)
        + "\n"
        + VERDICT
    )
    print(body)
    if not args.no_write:
        panels = {label: mean_curves(results, methods, key) for label, key in columns}
        png = plot_panels(RESULTS / f"{name}.png", panels, "FedDAR §5.1 synthetic: mean client test MSE")
        if png is not None:
            body += f"\n![learning curves]({png.name})\n"
        argv_text = " ".join(sys.argv[1:] if argv is None else argv)
        path = write_result(name, body, command=f"python -m benchmarks.feddar_synthetic {argv_text}")
        print(f"wrote {path}", file=sys.stderr)
    return {"ratios": ratios, "results": results, "config": asdict(cfg), "wall": wall}


if __name__ == "__main__":
    main()

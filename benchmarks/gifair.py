"""GIFAIR-FL (Yue, Nouiehed & Kontar; IoFT talk): group-loss spread of FedAvg vs group-fair reweighting.

``python -m benchmarks.gifair [--quick] [--seeds 0 1 2] [--lams 0.05 0.1 0.2 0.4] [--loss-metric NAME]``

A simulated fleet of two machine kinds of unequal size: ``--big`` printers of kind A
(16) and ``--small`` of kind B (4), each learning the same linear map from ``d``
per-layer features to a target (think vibration statistics → speed).  Kind B is
shifted in both ways the talk names: covariates (its features have another mean
and scale) and concept (its coefficients differ by ``shift``).  Every client has
``n`` training and ``n`` test rows; label noise σ.

Every method trains one global ``linear`` model with FedAvg's client (full-batch
SGD, one local step per round, so that reweighting the uploads is exactly one
gradient step on the reweighted objective) and differs only in the server's
weighting: FedAvg's ``uniform`` (p_i = 1/N, the talk's p_i), or ``gifair`` with
``λ`` and the device → kind map (:class:`cloud_aggregator.aggregation.weighting.GifairWeighting`).
GIFAIR ranks groups by the uploads' ``train_loss_start`` (the downlinked global
model's loss on each device's *training* rows, before the local step: the talk's
``F_i(w)``, the weighting's default).  ``--loss-metric test_loss`` ranks by the
held-out split instead -- the split the scores below come from, so the weights are
then steered by the evaluation data (kept only to compare).

Scores, on the test splits, of the final global model: the group losses
``L_A, L_B`` (mean of the members' losses), their spread ``max − min`` and variance,
the mean client loss, and the variance of client losses (individual fairness).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import logging
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, markdown_table, progress, study_parser, write_result
from cloud_aggregator.rounds.simulation import ClientData, simulate
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

# The paper's claim, in its words (its evidence is image classification and text prediction).
CLAIM = (
    "improved fairness (lower variance / spread of group losses) while retaining superior or similar "
    "prediction accuracy (abstract); the talk: λ balances fairness and goodness-of-fit"
)


RANKED_BY = {
    "train_loss_start": " (the downlinked global model's loss on each device's training rows, before its step)",
    "test_loss": " (the downlinked global model on each device's test rows -- the split scored below)",
}


@dataclass(frozen=True)
class StudyConfig:
    big: int = 16
    small: int = 4
    d: int = 5
    n: int = 40
    sigma: float = 0.3
    shift: float = 1.0
    covariate_shift: float = 0.5
    rounds: int = 200
    lr: float = 0.1
    curve_every: int = 5


@dataclass(frozen=True)
class Job:
    lam: float | None  # None: FedAvg
    seed: int
    cfg: StudyConfig
    loss_metric: str | None = None  # GIFAIR's F_i; None: the weighting's default (train_loss_start)


def fleet(cfg: StudyConfig, seed: int) -> tuple[dict[str, ClientData], dict[str, str]]:
    """``(clients, device → kind)`` for the two-kind fleet (see the module docstring)."""
    rng = np.random.default_rng(seed)
    beta = rng.standard_normal(cfg.d) / np.sqrt(cfg.d)
    delta = rng.standard_normal(cfg.d)
    delta *= cfg.shift / np.linalg.norm(delta)
    kinds = {"A": (beta, 0.0, 1.0), "B": (beta + delta, cfg.covariate_shift, 1.0 + cfg.covariate_shift)}
    clients, groups = {}, {}
    for kind, count in (("A", cfg.big), ("B", cfg.small)):
        coef, mean, scale = kinds[kind]
        for j in range(count):
            name = f"{kind.lower()}{j:02d}"

            def draw(coef=coef, mean=mean, scale=scale) -> Dataset:
                x = mean + scale * rng.standard_normal((cfg.n, cfg.d))
                return Dataset(x, (x @ coef + cfg.sigma * rng.standard_normal(cfg.n))[:, None])

            clients[name] = ClientData(draw(), draw())
            groups[name] = kind
    return clients, groups


def task_spec(
    cfg: StudyConfig, lam: float | None, groups: dict[str, str], seed: int, loss_metric: str | None = None
) -> TaskSpec:
    server: dict[str, Any] = {"weighting": "uniform"}
    if lam is not None:
        args: dict[str, Any] = {"lam": lam, "groups": groups, "base": "uniform"}
        if loss_metric is not None:
            args["loss_metric"] = loss_metric
        server = {"weighting": "gifair", "weighting_args": args}
    return TaskSpec(
        name="gifair",
        algorithm="fedavg",
        model="linear",
        model_args={"d_in": cfg.d, "d_out": 1},
        hparams={"optimizer": "sgd", "lr": cfg.lr, "local_steps": 1},
        server=server,
        dtype="float64",
        rounds=cfg.rounds,
        seed=seed,
    )


def group_scores(losses: dict[str, float], groups: dict[str, str]) -> dict[str, float]:
    """Group losses, their spread and variance, the mean client loss and the client-loss variance."""
    by = {
        g: float(np.mean([v for d, v in losses.items() if groups[d] == g]))
        for g in sorted(set(groups.values()))
    }
    vals = np.array(list(by.values()))
    client = np.array(list(losses.values()))
    return {
        **{f"L_{g}": v for g, v in by.items()},
        "spread": float(vals.max() - vals.min()),
        "group_var": float(vals.var()),
        "mean": float(client.mean()),
        "client_var": float(client.var()),
    }


def run_job(job: Job) -> dict[str, Any]:
    logging.getLogger("cloud_aggregator").setLevel(logging.ERROR)
    cfg = job.cfg
    clients, groups = fleet(cfg, job.seed)
    spec = task_spec(cfg, job.lam, groups, job.seed, job.loss_metric)
    curve: list[tuple[int, float, float]] = []

    def on_record(rec, fl, global_params) -> None:
        if rec.round % cfg.curve_every == 0 or rec.round == cfg.rounds:
            losses = {d: m["loss"] for d, m in fl.evaluate(global_params).items()}
            s = group_scores(losses, groups)
            curve.append((rec.round, s["spread"], s["mean"]))

    start = time.perf_counter()
    final, fl, _ = simulate(spec, clients, on_record=on_record)
    losses = {d: m["loss"] for d, m in fl.evaluate(final).items()}
    return {
        "lam": job.lam,
        "seed": job.seed,
        "scores": group_scores(losses, groups),
        "curve": curve,
        "seconds": time.perf_counter() - start,
    }


def label(lam: float | None) -> str:
    return "FedAvg" if lam is None else f"GIFAIR λ = {lam:g}"


def ms(values: Sequence[float], digits: int = 4) -> str:
    vals = np.asarray(values, dtype=float)
    std = vals.std(ddof=1) if len(vals) > 1 else 0.0
    return f"{vals.mean():.{digits}f} ± {std:.{digits}f}"


def table(results: Sequence[dict[str, Any]], lams: Sequence[float | None]) -> str:
    base = {r["seed"]: r["scores"] for r in results if r["lam"] is None}
    rows = []
    for lam in lams:
        rs = [r for r in results if r["lam"] == lam]
        sc = [r["scores"] for r in rs]
        ratio = [r["scores"]["spread"] / base[r["seed"]]["spread"] for r in rs]
        dmean = [100 * (r["scores"]["mean"] / base[r["seed"]]["mean"] - 1) for r in rs]
        rows.append(
            [
                label(lam),
                ms([s["L_A"] for s in sc]),
                ms([s["L_B"] for s in sc]),
                ms([s["spread"] for s in sc]),
                ms([s["group_var"] for s in sc], 5),
                f"{np.mean(ratio):.2f}",
                ms([s["mean"] for s in sc]),
                f"{np.mean(dmean):+.1f}%",
                ms([s["client_var"] for s in sc], 5),
            ]
        )
    headers = [
        "method",
        "L_A (16)",
        "L_B (4)",
        "spread max−min",
        "group-loss var",
        "spread ÷ FedAvg",
        "mean client loss",
        "mean vs FedAvg",
        "client-loss var",
    ]
    return markdown_table(headers, rows)


def plot(path, results: Sequence[dict[str, Any]], lams: Sequence[float | None]):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for lam in lams:
        rs = [r for r in results if r["lam"] == lam]
        xs = [c[0] for c in rs[0]["curve"]]
        axes[0].plot(xs, np.mean([[c[1] for c in r["curve"]] for r in rs], axis=0), label=label(lam))
        sp = [r["scores"]["spread"] for r in rs]
        mean = [r["scores"]["mean"] for r in rs]
        axes[1].errorbar(
            np.mean(mean), np.mean(sp), xerr=np.std(mean), yerr=np.std(sp), fmt="o", label=label(lam)
        )
    axes[0].set_yscale("log")
    axes[0].set_xlabel("round")
    axes[0].set_ylabel("group-loss spread max−min (test)")
    axes[0].set_title("spread during training (mean over seeds)")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("mean client test loss")
    axes[1].set_ylabel("group-loss spread")
    axes[1].set_title("final: fairness vs fit (± std over seeds)")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse(argv: Sequence[str] | None = None):
    parser = study_parser(__doc__.splitlines()[0])
    parser.add_argument("--lams", type=float, nargs="+", default=None, help="GIFAIR λ values")
    parser.add_argument(
        "--rounds", type=int, default=None, help="communication rounds (default 200; quick 80)"
    )
    parser.add_argument("--big", type=int, default=None, help="clients of kind A (default 16)")
    parser.add_argument("--small", type=int, default=None, help="clients of kind B (default 4)")
    parser.add_argument(
        "--loss-metric",
        default=None,
        help="the upload metric GIFAIR ranks groups by (default: train_loss_start, the downlinked "
        "model on the training rows; test_loss uses the split the study scores on)",
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    cfg = StudyConfig()
    lam_values = args.lams or [0.05, 0.1, 0.2, 0.4]
    if args.quick:
        cfg = replace(cfg, rounds=80)
        lam_values = args.lams or [0.1]
    overrides = {"rounds": args.rounds, "big": args.big, "small": args.small}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    lams: list[float | None] = [None, *lam_values]
    name = "gifair" + ("_quick" if args.quick else "")
    if args.loss_metric is not None:
        name += f"_{args.loss_metric}"
    metric = args.loss_metric or "train_loss_start"
    jobs = [Job(lam, s, cfg, args.loss_metric) for lam in lams for s in args.seeds]
    start = time.perf_counter()
    results = []
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futures = [pool.submit(run_job, j) for j in jobs]
        for fut in progress(as_completed(futures), name, total=len(futures)):
            results.append(fut.result())
    wall = time.perf_counter() - start
    results.sort(key=lambda r: (-1.0 if r["lam"] is None else r["lam"], r["seed"]))
    bound = min(cfg.big, cfg.small) / (cfg.big + cfg.small)
    body = (
        f"Fleet: {cfg.big} clients of kind A and {cfg.small} of kind B, d = {cfg.d} features, n = {cfg.n} train "
        f"and {cfg.n} test rows per client, noise σ = {cfg.sigma:g}; kind B: coefficient shift ‖δ‖ = {cfg.shift:g}, "
        f"feature mean +{cfg.covariate_shift:g}, scale ×{1 + cfg.covariate_shift:g}.  FedAvg client, full-batch SGD "
        f"lr {cfg.lr:g}, 1 local step, {cfg.rounds} rounds, p_i = 1/N; GIFAIR ranks groups by the uploads' "
        f"{metric}{RANKED_BY.get(metric, '')}.  Weights stay non-negative for λ ≤ p_i|A_si|/(G − 1) = {bound:g} (the small group); above it "
        f"the small group's weight is clipped at 0 in rounds where it ranks lower.  Test losses of the final global "
        f"model, mean ± std over seeds {list(args.seeds)}.\n\n{table(results, lams)}\n\n"
        f"Paper's claim: {CLAIM}.\n\nWall time {wall:.0f} s on {args.workers} worker(s); "
        f"{np.mean([r['seconds'] for r in results]):.1f} s per run.\n"
    )
    print(body)
    if not args.no_write:
        png = plot(RESULTS / f"{name}.png", results, lams)
        if png is not None:
            body += f"\n![spread and fit]({png.name})\n"
        argv_text = " ".join(sys.argv[1:] if argv is None else argv)
        path = write_result(name, body, command=f"python -m benchmarks.gifair {argv_text}")
        print(f"wrote {path}", file=sys.stderr)
    return {"results": results, "config": asdict(cfg), "wall": wall}


if __name__ == "__main__":
    main()

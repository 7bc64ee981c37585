"""Personalized PCA (Shi & Kontar, JMLR 2024; IoFT talk): subspace recovery across θ, and vibration anomaly scores.

``python -m benchmarks.perpca [--quick] [--seeds 0 1 2] [--alphas 10 20 30 45 60 90 120 180]``

Part 1 -- recovery.  The generator is the authors' θ study (``toy_example1`` in
github.com/soundsinteresting/perpca ``ppca.py``: one global direction, two local
directions rotated by ±α/2 about a common one, global scale 1, local scale 2)
widened to N clients in d dimensions: a random orthonormal basis ``Q`` gives the
true global components ``U* = Q[:, :r1]``, a common local block ``B = Q[:, r1:r1+r2]``
and, per client, ``V*_i = cos(α/2) B + sin(α/2) C_i`` with ``C_i`` a random
orthonormal r2-frame in the remaining directions (so ``[U*, V*_i]`` is orthonormal).
Client ``i`` draws ``n`` rows ``x = σ_g U* a + σ_l V*_i b + σ ε`` (``a, b, ε``
standard normal).  The heterogeneity is the paper's eq. (5),
``θ = 1 − λ_max((1/N) Σ_i Π_i)``, computed from the drawn ``V*_i``.  The score is
the paper's error ``‖P_Û − Π_g‖_F² + (1/N) Σ_i ‖P_V̂i − Π_i‖_F²`` (decoupled), and
beside it the per-client error of the combined subspace
``(1/N) Σ_i ‖P_[Û,V̂i] − (Π_g + Π_i)‖_F²``, which needs no global/local split.

- PerPCA: the federated algorithm (``perpca`` client and strategy, random start,
  step ``lr = 1 / median_i λ_max(S_i)``; at 2 / λ_max the local blocks
  oscillate and the error floor is five times higher).
- Pooled PCA (homogeneous): top r1 eigenvectors of the pooled covariance as Û;
  each client's top r2 of its covariance deflated off Û as V̂_i.
- Local PCA: each client's own top r1 + r2 eigenvectors, the first r1 taken as
  global.  One client cannot tell shared from unique components (the talk's
  identifiability slide), so its decoupled error is mostly a wrong split; its
  combined error is the fair comparison.

Part 2 -- vibration anomalies.  Simulated printers (:mod:`sensors.sim.vibration`,
2 axes at 227 Hz, 256-sample windows, one window per layer) give training windows
(a few layers per speed setting) and test windows from another run, half of which
get an injected tone (``amp`` × the window RMS on both axes): anywhere in
5–110 Hz, or in the 35–55 Hz band where the simulated frame resonances sit
(normal for some printer, anomalous for this one).  Features: square-root
magnitude spectra, adjacent bins summed (64 per axis).  Each printer centres
with its own training mean; the anomaly score is the squared residual off its
subspace; AUROC per printer, averaged.
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
from trainer_lite.algorithms.perpca import residual
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

METHODS = ("PerPCA", "Pooled PCA", "Local PCA")
VIB_METHODS = ("PerPCA", "Pooled PCA", "Pooled + deflation", "Local PCA")
ANOMALIES = {"tone 5-110 Hz": (5.0, 110.0), "tone 35-55 Hz (resonance band)": (35.0, 55.0)}
# What the paper and talk claim, in their words (the paper's figures are plots, not tables).
CLAIMS = {
    "recovery": "global and local subspaces recovered by problem (4) once θ > 0; error O((d + log N)/(n θ δ²))",
    "rate": "linear convergence, faster for larger θ (ω(θ) grows with θ)",
    "baselines": "homogeneous PCA cannot separate shared from unique features (talk Fig. 9)",
}


@dataclass(frozen=True)
class SynthConfig:
    """Part 1's generator and training budget (see the module docstring)."""

    d: int = 10
    r1: int = 2
    r2: int = 2
    n_clients: int = 20
    n: int = 50
    sigma_g: float = 1.0
    sigma_l: float = 2.0
    noise: float = 0.3
    rounds: int = 400
    lr_scale: float = 1.0


@dataclass(frozen=True)
class VibConfig:
    """Part 2's fleet, features and budget."""

    printers: int = 8
    train_layers: int = 4
    test_layers: int = 8
    r1: int = 8
    r2: int = 2
    rounds: int = 200
    lr_scale: float = 1.0
    anomaly_frac: float = 0.5
    amp: float = 0.5


# -- linear algebra shared by the baselines and the scores ---------------------------------


def top_eigvecs(s: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` leading eigenvectors of the symmetric ``s`` (columns)."""
    _, vecs = np.linalg.eigh(s)
    return vecs[:, ::-1][:, :k]


def proj(a: np.ndarray) -> np.ndarray:
    return a @ a.T


def decoupled_error(
    u_hat: np.ndarray, v_hat: Sequence[np.ndarray], u: np.ndarray, v: Sequence[np.ndarray]
) -> float:
    """``‖P_Û − Π_g‖² + mean_i ‖P_V̂i − Π_i‖²`` (Frobenius); ``u_hat`` may be one per client (stacked)."""
    us = u_hat if u_hat.ndim == 3 else u_hat[None]
    g = float(np.mean([np.linalg.norm(proj(x) - proj(u)) ** 2 for x in us]))
    return g + float(np.mean([np.linalg.norm(proj(a) - proj(b)) ** 2 for a, b in zip(v_hat, v, strict=True)]))


def combined_error(
    u_hat: np.ndarray, v_hat: Sequence[np.ndarray], u: np.ndarray, v: Sequence[np.ndarray]
) -> float:
    """``mean_i ‖P_[Û,V̂i] − (Π_g + Π_i)‖²``: each client's whole subspace, split ignored."""
    us = u_hat if u_hat.ndim == 3 else np.repeat(u_hat[None], len(v), axis=0)
    return float(
        np.mean(
            [
                np.linalg.norm(proj(np.hstack([a, b])) - proj(np.hstack([u, c]))) ** 2
                for a, b, c in zip(us, v_hat, v, strict=True)
            ]
        )
    )


def pooled_pca(covs: Sequence[np.ndarray], r1: int, r2: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Homogeneous PCA: Û from the pooled covariance, V̂_i from each covariance deflated off Û."""
    u = top_eigvecs(np.mean(covs, axis=0), r1)
    deflate = np.eye(len(u)) - proj(u)
    return u, [top_eigvecs(deflate @ s @ deflate, r2) for s in covs]


def local_pca(covs: Sequence[np.ndarray], r1: int, r2: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each client alone: its top r1 as Û_i, the next r2 as V̂_i."""
    tops = [top_eigvecs(s, r1 + r2) for s in covs]
    return np.stack([t[:, :r1] for t in tops]), [t[:, r1:] for t in tops]


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: P(score of an anomaly > score of a normal window), ties half."""
    pos, neg = scores[labels], scores[~labels]
    if not len(pos) or not len(neg):
        raise ValueError("AUROC needs both anomalous and normal windows")
    diff = pos[:, None] - neg[None, :]
    return float(np.mean(diff > 0) + 0.5 * np.mean(diff == 0))


def run_perpca(
    data: dict[str, np.ndarray],
    r1: int,
    r2: int,
    rounds: int,
    lr_scale: float,
    seed: int,
    u_true: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], list[float]]:
    """The federated algorithm over in-process clients: ``(U, {client: V_i}, curve)``.

    The curve is ``‖P_U − Π_g‖_F²`` after each round when ``u_true`` is given, else the
    mean training residual the devices reported.
    """
    covs = [np.cov(x, rowvar=False, bias=True) for x in data.values()]
    lr = lr_scale / float(np.median([np.linalg.eigvalsh(s)[-1] for s in covs]))
    d = next(iter(data.values())).shape[1]
    spec = TaskSpec(
        name="perpca",
        algorithm="perpca",
        model="perpca",
        hparams={"dim": d, "r_global": r1, "r_local": r2, "lr": lr},
        dtype="float64",
        rounds=rounds,
        seed=seed,
    )
    clients = {k: ClientData(Dataset(x, np.zeros((len(x), 1)))) for k, x in data.items()}
    curve: list[float] = []

    def on_record(rec, fleet, global_params) -> None:
        if u_true is None:
            curve.append(float(rec.mean_metric("train_loss") or np.nan))
        else:
            curve.append(float(np.linalg.norm(proj(global_params["U"]) - proj(u_true)) ** 2))

    final, fleet, _ = simulate(spec, clients, on_record=on_record)
    v = {k: fleet.algo.personal_params(final, fleet.local[k])["V"] for k in data}
    return final["U"], v, curve


# -- part 1: recovery across θ --------------------------------------------------------------


def synthetic_fleet(
    cfg: SynthConfig, alpha_deg: float, seed: int
) -> tuple[dict[str, np.ndarray], np.ndarray, list[np.ndarray], float]:
    """``(client data, U*, [V*_i], θ)`` for rotation angle α (degrees); see the module docstring."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((cfg.d, cfg.d)))
    u, b, rest = q[:, : cfg.r1], q[:, cfg.r1 : cfg.r1 + cfg.r2], q[:, cfg.r1 + cfg.r2 :]
    if rest.shape[1] < cfg.r2:
        raise ValueError(f"d = {cfg.d} leaves no room for client-specific local directions")
    half = np.deg2rad(alpha_deg) / 2
    data, vs = {}, []
    for i in range(cfg.n_clients):
        c = rest @ np.linalg.qr(rng.standard_normal((rest.shape[1], cfg.r2)))[0]
        v = np.cos(half) * b + np.sin(half) * c
        x = (
            cfg.sigma_g * rng.standard_normal((cfg.n, cfg.r1)) @ u.T
            + cfg.sigma_l * rng.standard_normal((cfg.n, cfg.r2)) @ v.T
            + cfg.noise * rng.standard_normal((cfg.n, cfg.d))
        )
        data[f"c{i:03d}"] = x
        vs.append(v)
    theta = 1.0 - float(np.linalg.eigvalsh(np.mean([proj(v) for v in vs], axis=0))[-1])
    return data, u, vs, theta


@dataclass(frozen=True)
class SynthJob:
    alpha: float
    seed: int
    cfg: SynthConfig


def run_synth(job: SynthJob) -> dict[str, Any]:
    logging.getLogger("cloud_aggregator").setLevel(logging.ERROR)
    cfg = job.cfg
    data, u, vs, theta = synthetic_fleet(cfg, job.alpha, job.seed)
    covs = [np.cov(x, rowvar=False, bias=True) for x in data.values()]
    start = time.perf_counter()
    u_hat, v_hat, curve = run_perpca(data, cfg.r1, cfg.r2, cfg.rounds, cfg.lr_scale, job.seed, u)
    seconds = time.perf_counter() - start
    estimates = {
        "PerPCA": (u_hat, [v_hat[k] for k in data]),
        "Pooled PCA": pooled_pca(covs, cfg.r1, cfg.r2),
        "Local PCA": local_pca(covs, cfg.r1, cfg.r2),
    }
    return {
        "alpha": job.alpha,
        "seed": job.seed,
        "theta": theta,
        "decoupled": {m: decoupled_error(*e, u, vs) for m, e in estimates.items()},
        "combined": {m: combined_error(*e, u, vs) for m, e in estimates.items()},
        "curve": curve,
        "seconds": seconds,
    }


# -- part 2: vibration anomalies ----------------------------------------------------------------


def spectra(windows: np.ndarray) -> np.ndarray:
    """Square-root magnitude spectra, adjacent bins summed: ``(n, 2, 256) -> (n, 128)``."""
    mag = np.abs(np.fft.rfft(windows.astype(np.float64), axis=-1))[:, :, 1:129]
    mag = mag.reshape(len(windows), windows.shape[1], 64, 2).sum(axis=-1)
    return np.sqrt(mag).reshape(len(windows), -1)


def inject_tones(
    windows: np.ndarray, rng: np.random.Generator, frac: float, amp: float, band: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray]:
    """Add a tone of random frequency in ``band`` to a random ``frac`` of the windows; ``(windows, is_anomaly)``."""
    from sensors.sim.vibration import WINDOW_SCHEMA

    out = windows.astype(np.float64, copy=True)
    labels = np.zeros(len(out), dtype=bool)
    labels[rng.choice(len(out), size=max(1, int(frac * len(out))), replace=False)] = True
    t = np.arange(out.shape[-1]) / WINDOW_SCHEMA.sample_rate
    for i in np.flatnonzero(labels):
        f = rng.uniform(*band)
        for axis in range(out.shape[1]):
            rms = np.sqrt(np.mean(out[i, axis] ** 2))
            out[i, axis] += amp * rms * np.sqrt(2) * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
    return out, labels


def run_vibration(cfg: VibConfig, seed: int) -> dict[str, Any]:
    """Train every method on normal windows of ``cfg.printers`` printers; AUROC per anomaly type."""
    from sensors.sim.vibration import simulate_windows

    logging.getLogger("cloud_aggregator").setLevel(logging.ERROR)
    rng = np.random.default_rng(seed)
    names = [f"printer-{i:02d}" for i in range(cfg.printers)]
    train = {n: spectra(simulate_windows(n, seed=2 * seed, layers=cfg.train_layers)[0]) for n in names}
    raw_test = {n: simulate_windows(n, seed=2 * seed + 1, layers=cfg.test_layers)[0] for n in names}
    means = {n: x.mean(axis=0) for n, x in train.items()}
    covs = {n: np.cov(x, rowvar=False, bias=True) for n, x in train.items()}
    start = time.perf_counter()
    u_per, v_per, _ = run_perpca(train, cfg.r1, cfg.r2, cfg.rounds, cfg.lr_scale, seed)
    seconds = time.perf_counter() - start
    k = cfg.r1 + cfg.r2
    pooled = top_eigvecs(np.mean(list(covs.values()), axis=0), k)  # same dimension as [U, V_i]
    u_defl, v_defl = pooled_pca(list(covs.values()), cfg.r1, cfg.r2)
    empty = np.zeros((pooled.shape[0], 0))
    bases = {
        "PerPCA": {n: (u_per, v_per[n]) for n in names},
        "Pooled PCA": {n: (pooled, empty) for n in names},
        "Pooled + deflation": {n: (u_defl, v) for n, v in zip(names, v_defl, strict=True)},
        "Local PCA": {n: (top_eigvecs(covs[n], k), empty) for n in names},
    }
    out: dict[str, dict[str, float]] = {}
    for label, band in ANOMALIES.items():
        tests = {n: inject_tones(w, rng, cfg.anomaly_frac, cfg.amp, band) for n, w in raw_test.items()}
        out[label] = {
            m: float(
                np.mean([auroc(residual(spectra(tests[n][0]), *b[n], means[n]), tests[n][1]) for n in names])
            )
            for m, b in bases.items()
        }
    return {"seed": seed, "auroc": out, "seconds": seconds, "n_train": len(next(iter(train.values())))}


# -- reporting ---------------------------------------------------------------------------------------


def ms(values: Sequence[float], digits: int = 3) -> str:
    vals = np.asarray(values, dtype=float)
    std = vals.std(ddof=1) if len(vals) > 1 else 0.0
    return f"{vals.mean():.{digits}f} ± {std:.{digits}f}"


def synth_table(results: Sequence[dict[str, Any]], alphas: Sequence[float], key: str) -> str:
    rows = []
    for a in alphas:
        rs = [r for r in results if r["alpha"] == a]
        rows.append(
            [
                f"{a:g}°",
                f"{np.mean([r['theta'] for r in rs]):.3f}",
                *[ms([r[key][m] for r in rs]) for m in METHODS],
            ]
        )
    return markdown_table(["α", "θ (eq. 5)", *METHODS], rows)


def rounds_to(curve: Sequence[float], tol: float) -> int | None:
    """The first round after which ``‖P_U − Π_g‖² < tol`` holds to the end (``None``: never)."""
    above = [i for i, e in enumerate(curve) if e >= tol]
    if not above:
        return 1
    return above[-1] + 2 if above[-1] + 1 < len(curve) else None


def rate_table(results: Sequence[dict[str, Any]], alphas: Sequence[float], tols: Sequence[float]) -> str:
    """Rounds PerPCA needs before its global-subspace error stays below each tolerance, per θ."""
    rows = []
    for a in alphas:
        rs = [r for r in results if r["alpha"] == a]
        cells = []
        for tol in tols:
            got = [rounds_to(r["curve"], tol) for r in rs]
            done = [g for g in got if g is not None]
            cells.append(
                (f"{np.mean(done):.0f}" if done else "–")
                + (f" ({len(got) - len(done)} never)" if len(done) < len(got) else "")
            )
        rows.append([f"{a:g}°", f"{np.mean([r['theta'] for r in rs]):.3f}", *cells])
    return markdown_table(["α", "θ", *[f"rounds to ‖P_U − Π_g‖² < {t:g}" for t in tols]], rows)


def vib_table(results: Sequence[dict[str, Any]]) -> str:
    rows = [[m, *[ms([r["auroc"][a][m] for r in results]) for a in ANOMALIES]] for m in VIB_METHODS]
    return markdown_table(["method", *[f"AUROC, {a}" for a in ANOMALIES]], rows)


def plot(path, synth: Sequence[dict[str, Any]], alphas: Sequence[float], vib: Sequence[dict[str, Any]]):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    thetas = [np.mean([r["theta"] for r in synth if r["alpha"] == a]) for a in alphas]
    for ax, key, title in (
        (axes[0], "decoupled", "decoupled error"),
        (axes[1], "combined", "combined error"),
    ):
        for m in METHODS:
            ys = [np.mean([r[key][m] for r in synth if r["alpha"] == a]) for a in alphas]
            ax.plot(thetas, ys, marker="o", label=m)
        ax.set_yscale("log")
        ax.set_xlabel("heterogeneity θ")
        ax.set_title(f"recovery: {title}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("‖P − Π‖_F² (mean over seeds)")
    axes[0].legend(fontsize=8)
    for a in alphas:
        rs = [r for r in synth if r["alpha"] == a]
        curve = np.mean([r["curve"] for r in rs], axis=0)
        theta = np.mean([r["theta"] for r in rs])
        axes[2].plot(np.arange(1, len(curve) + 1), curve, label=f"θ = {theta:.3f}")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("round")
    axes[2].set_title("PerPCA: ‖P_U − Π_g‖² per round")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    if not vib:  # part 2 skipped
        axes[3].set_visible(False)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
    xs = np.arange(len(ANOMALIES))
    width = 0.8 / len(VIB_METHODS)
    for j, m in enumerate(VIB_METHODS):
        ys = [np.mean([r["auroc"][a][m] for r in vib]) for a in ANOMALIES]
        axes[3].bar(xs + j * width, ys, width, label=m)
    axes[3].set_xticks(xs + 0.4 - width / 2, list(ANOMALIES), fontsize=8)
    axes[3].set_ylim(0.5, 1.0)
    axes[3].set_title("vibration anomalies: mean AUROC")
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the study -------------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None = None):
    parser = study_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--alphas", type=float, nargs="+", default=None, help="rotation angles α in degrees (sets θ)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="PerPCA rounds (synthetic part)")
    parser.add_argument("--n", type=int, default=None, help="samples per client (synthetic part)")
    parser.add_argument(
        "--swap-scales", action="store_true", help="global scale 2, local scale 1 (the toy has 1 and 2)"
    )
    parser.add_argument(
        "--lr-scale",
        type=float,
        default=None,
        help="PerPCA step lr = LR_SCALE / median λ_max(S_i) (default 1)",
    )
    parser.add_argument("--no-vibration", action="store_true", help="skip part 2")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    cfg = SynthConfig()
    vcfg = VibConfig()
    alphas = args.alphas or [10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0]
    if args.quick:
        cfg = replace(cfg, n_clients=10, rounds=150)
        vcfg = replace(vcfg, printers=4, test_layers=4, rounds=100)
        alphas = args.alphas or [10.0, 60.0]
    if args.swap_scales:
        cfg = replace(cfg, sigma_g=cfg.sigma_l, sigma_l=cfg.sigma_g)
    cfg = replace(cfg, **{k: v for k, v in {"rounds": args.rounds, "n": args.n}.items() if v is not None})
    if args.lr_scale is not None:
        cfg, vcfg = replace(cfg, lr_scale=args.lr_scale), replace(vcfg, lr_scale=args.lr_scale)
    name = "perpca" + ("_swapped" if args.swap_scales else "") + ("_quick" if args.quick else "")
    start = time.perf_counter()
    jobs = [SynthJob(a, s, cfg) for a in alphas for s in args.seeds]
    synth: list[dict[str, Any]] = []
    vib: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futures = [pool.submit(run_synth, j) for j in jobs]
        if not args.no_vibration:
            futures += [pool.submit(run_vibration, vcfg, s) for s in args.seeds]
        for fut in progress(as_completed(futures), name, total=len(futures)):
            res = fut.result()
            (synth if "alpha" in res else vib).append(res)
    wall = time.perf_counter() - start
    synth.sort(key=lambda r: (r["alpha"], r["seed"]))
    vib.sort(key=lambda r: r["seed"])

    body = (
        f"Part 1 -- recovery. d = {cfg.d}, r1 = {cfg.r1}, r2 = {cfg.r2}, N = {cfg.n_clients} clients × n = {cfg.n} "
        f"samples, σ_g = {cfg.sigma_g:g}, σ_l = {cfg.sigma_l:g}, noise σ = {cfg.noise:g}; PerPCA {cfg.rounds} rounds "
        f"from a random start, one Stiefel step per round of lr = {cfg.lr_scale:g}/median λ_max(S_i); "
        f"seeds {list(args.seeds)}; mean ± std over seeds.\n\n"
        "Decoupled error ‖P_Û − Π_g‖_F² + mean_i ‖P_V̂i − Π_i‖_F² (the paper's metric; 0 is perfect, "
        f"{2 * (cfg.r1 + cfg.r2)} the worst):\n\n{synth_table(synth, alphas, 'decoupled')}\n\n"
        "Combined error mean_i ‖P_[Û,V̂i] − (Π_g + Π_i)‖_F² (no global/local split needed):\n\n"
        f"{synth_table(synth, alphas, 'combined')}\n\n"
        "Convergence (the talk: faster for larger θ) -- rounds until PerPCA's global error stays below a "
        f"tolerance, mean over seeds:\n\n{rate_table(synth, alphas, (0.5, 0.1))}\n\n"
        f"PerPCA run time per fit: {np.mean([r['seconds'] for r in synth]):.1f} s.\n"
    )
    if vib:
        body += (
            f"\nPart 2 -- vibration anomalies. {vcfg.printers} simulated printers, {vib[0]['n_train']} training "
            f"windows each ({vcfg.train_layers} layers × 12 speed settings), {vcfg.test_layers * 12} test windows each, "
            f"{vcfg.anomaly_frac:.0%} with an injected tone of {vcfg.amp:g} × RMS; 128 spectral features; PerPCA "
            f"r1 = {vcfg.r1}, r2 = {vcfg.r2}, {vcfg.rounds} rounds; Pooled and Local PCA keep r1 + r2 = "
            f"{vcfg.r1 + vcfg.r2} components; Pooled + deflation = pooled r1 + each printer's r2 of the deflated "
            f"covariance. Mean AUROC over printers, mean ± std over seeds {list(args.seeds)}.\n\n{vib_table(vib)}\n"
        )
    claims = markdown_table(["claim (paper / talk)", "words"], [[k, v] for k, v in CLAIMS.items()])
    body += f"\nWhat the paper and the talk claim:\n\n{claims}\n\nWall time {wall:.0f} s on {args.workers} worker(s).\n"
    print(body)
    if not args.no_write:
        png = plot(RESULTS / f"{name}.png", synth, alphas, vib)
        if png is not None:
            body += f"\n![recovery and AUROC]({png.name})\n"
        argv_text = " ".join(sys.argv[1:] if argv is None else argv)
        path = write_result(name, body, command=f"python -m benchmarks.perpca {argv_text}")
        print(f"wrote {path}", file=sys.stderr)
    return {"synth": synth, "vib": vib, "config": asdict(cfg), "vib_config": asdict(vcfg), "wall": wall}


if __name__ == "__main__":
    main()

"""Why Ditto's Table 5 sigmoid-GLM figure depends on the seed.

``python -m benchmarks.ditto_diagnose [--seeds 0 1 2 3 4] [--variant authors] [--show 1 10 50 200] [--summary] [--trace]``

Runs the study's Ditto (:func:`benchmarks.pflda_printers.method_spec`, the PFL-DA
authors' baseline) on the sigmoid GLM and prints, per seed, what decides its
final test loss:

- the initial global encoder ``a0·x + b0`` and decoder ``w1·σ(h) + w2``;
- how far the global encoder moved in 200 rounds (the authors' pull of the
  device's copy of the global encoder back to ``w^t`` freezes it);
- how far each personal decoder sits from the global decoder (the convex pull
  ``v ← 0.9·w + 0.1·v`` after every step pins it there);
- the output range of the final decoder, ``(w2, w2 + w1)``, beside the printers'
  training targets s/50, the share of those targets inside it, and the lowest
  training loss any personal encoder ``|a|, |b| <= 8`` reaches through that decoder
  (the floor: a personal model cannot fit speeds its pinned decoder cannot output);
- the test loss (50·MSE(s/50) on the Speed30 files) at a few rounds.

``--variant`` runs a what-if: ``free-global`` leaves the global encoder free
(no ``global_pull``), ``paper`` is Ditto as its paper states it (``λ/2·‖v − w‖²``
on every parameter, the global trained by plain FedAvg; λ = 0.9), ``cold-start`` starts
every personal model as a copy of the initial global (the authors' Ditto otherwise).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.common import markdown_table
from benchmarks.pflda_printers import DEFAULT_DATA, load_runs, method_spec, replica_blocks, test_split
from benchmarks.pflda_sine import StackedFleet, run_stacked
from cloud_aggregator.aggregation.strategies import make_strategy
from trainer_lite.params import Params

#: What-if settings on top of the study's Ditto (the authors' baseline).
VARIANTS: dict[str, dict[str, Any]] = {
    "authors": {},
    "free-global": {"global_pull": []},
    "paper": {"pull": "gradient", "lam": 0.9, "personal_pull": None, "global_pull": []},
    "cold-start": {},  # the authors' Ditto, each personal model starting as a copy of the global
}
#: A seed whose final test loss exceeds this is "far off" (the good seeds end near 0.06-0.42).
FAR_OFF = 0.5
#: Box of personal encoders searched for the floor (2000 Adam steps at lr <= 3e-3 move a
#: parameter drawn in [-1, 1] by at most ~6).
FLOOR_BOX = 8.0


@dataclass
class SeedReport:
    """What one seed's Ditto run did (global parameters are scalars for the 1-D sigmoid GLM)."""

    seed: int
    init: dict[str, float]
    final: dict[str, float]
    encoder_drift: float
    decoder_gap: float
    target_range: tuple[float, float]
    covered: float
    floor: float
    train_loss: float
    test_curve: np.ndarray
    #: Per round: global decoder ``w1``, ``w2`` and each printer's personal encoder slope ``a_i``.
    w_curve: np.ndarray
    slopes: np.ndarray

    @property
    def decoder_range(self) -> tuple[float, float]:
        lo, hi = sorted((self.final["w2"], self.final["w2"] + self.final["w1"]))
        return lo, hi

    @property
    def far_off(self) -> bool:
        return bool(self.test_curve[-1] > FAR_OFF)

    @property
    def last_flip(self) -> int:
        """The round after which the global decoder's amplitude ``w1`` last changed sign (0: never)."""
        flips = np.flatnonzero(np.diff(np.sign(self.w_curve[:, 0])))
        return int(flips[-1] + 1) if len(flips) else 0


def _scalars(p: Params, r: int, prefix: str = "") -> dict[str, float]:
    """Replica ``r``'s four sigmoid-GLM parameters (one scalar each per replica)."""
    names = {"a": "encoder.scale", "b": "encoder.shift", "w1": "decoder.weight", "w2": "decoder.bias"}
    return {k: float(np.ravel(p[prefix + n])[r]) for k, n in names.items()}


def floor_loss(x: np.ndarray, y: np.ndarray, w1: float, w2: float, box: float = FLOOR_BOX) -> float:
    """Lowest 50·MSE of ``w1·σ(a·x + b) + w2`` over a grid of personal encoders ``|a|, |b| <= box``."""
    grid = np.linspace(-box, box, 161)
    a, b = np.meshgrid(grid, grid, indexing="ij")
    h = a[..., None] * x[None, None, :] + b[..., None]
    pred = w1 / (1.0 + np.exp(-h)) + w2
    return float(50.0 * np.mean((pred - y) ** 2, axis=-1).min())


def diagnose(runs: dict, seeds: Sequence[int], variant: str = "authors") -> list[SeedReport]:
    """Run Ditto on the sigmoid GLM for ``seeds`` (one stacked fleet) and report each seed."""
    spec = method_spec("sigmoid", "ditto", seeds[0], **VARIANTS[variant])
    blocks = replica_blocks(runs, [test_split(runs)], len(seeds), spec.dtype)
    fleet = StackedFleet(spec, blocks, replicas=list(seeds))
    start = fleet.initial_global(make_strategy(spec))
    if variant == "cold-start":
        for b, local in fleet.local.items():
            fleet.local[b] = {
                n: start[n.removeprefix("personal.")].reshape(v.shape).astype(v.dtype)
                for n, v in local.items()
            }
    curve: list[np.ndarray] = []
    ws: list[np.ndarray] = []
    slopes: list[np.ndarray] = []

    def on_round(rec, g: Params) -> None:
        curve.append(np.mean([50.0 * fleet.test_mse(g, b) for b in blocks], axis=0))
        ws.append(np.stack([np.ravel(g["decoder.weight"]), np.ravel(g["decoder.bias"])], axis=-1))
        slopes.append(np.stack([np.ravel(fleet.local[b]["personal.encoder.scale"]) for b in blocks], axis=-1))

    final = run_stacked(spec, fleet, on_round)
    curves = np.stack(curve)  # [round, replica]
    w_curves, slope_curves = np.stack(ws), np.stack(slopes)  # [round, replica, 2], [round, replica, printer]
    out = []
    for r, seed in enumerate(seeds):
        init, fin = _scalars(start, r), _scalars(final, r)
        ys = np.concatenate([blk.train.y[r, :, 0] for blk in blocks.values()]).astype(np.float64)
        gaps, floors, trains = [], [], []
        for b, blk in blocks.items():
            v = _scalars(fleet.local[b], r, "personal.")
            gaps.append(max(abs(v["w1"] - fin["w1"]), abs(v["w2"] - fin["w2"])))
            x, y = blk.train.x[r, :, 0].astype(np.float64), blk.train.y[r, :, 0].astype(np.float64)
            floors.append(floor_loss(x, y, fin["w1"], fin["w2"]))
            pred = v["w1"] / (1.0 + np.exp(-(v["a"] * x + v["b"]))) + v["w2"]
            trains.append(50.0 * np.mean((pred - y) ** 2))
        lo, hi = sorted((fin["w2"], fin["w2"] + fin["w1"]))
        out.append(
            SeedReport(
                seed=seed,
                init=init,
                final=fin,
                encoder_drift=max(abs(fin["a"] - init["a"]), abs(fin["b"] - init["b"])),
                decoder_gap=max(gaps),
                target_range=(float(ys.min()), float(ys.max())),
                covered=float(np.mean((ys >= lo) & (ys <= hi))),
                floor=float(np.mean(floors)),
                train_loss=float(np.mean(trains)),
                test_curve=curves[:, r],
                w_curve=w_curves[:, r],
                slopes=slope_curves[:, r],
            )
        )
    return out


def report_table(reports: Sequence[SeedReport], show_rounds: Sequence[int]) -> str:
    """One markdown row per seed."""
    rows = []
    for s in reports:
        i, f = s.init, s.final
        lo, hi = s.decoder_range
        rows.append(
            [
                s.seed,
                f"{s.test_curve[-1]:.3f}",
                f"{i['a']:+.3f}, {i['b']:+.3f}",
                f"{i['w1']:+.3f}, {i['w2']:+.3f}",
                f"{f['w1']:+.3f}, {f['w2']:+.3f}",
                s.last_flip or "never",
                f"{s.encoder_drift:.3f}",
                f"{s.decoder_gap:.1e}",
                f"[{lo:.2f}, {hi:.2f}]",
                f"{100 * s.covered:.0f}%",
                f"{s.floor:.3f}",
                f"{s.train_loss:.3f}",
                " / ".join(f"{s.test_curve[min(t, len(s.test_curve)) - 1]:.3g}" for t in show_rounds),
            ]
        )
    headers = [
        "seed",
        "test loss",
        "init global enc a0, b0",
        "init global dec w1, w2",
        "final global dec w1, w2",
        "w1 last changed sign after round",
        "global enc drift",
        "max |v_dec − w_dec|",
        "decoder output range",
        "train targets inside",
        "floor (train)",
        "personal train loss",
        "test loss at rounds " + ", ".join(map(str, show_rounds)),
    ]
    return markdown_table(headers, rows)


def trace_table(reports: Sequence[SeedReport], show_rounds: Sequence[int]) -> str:
    """Per seed: the global decoder's ``w1``, the personal encoder slopes' range and the test loss by round."""
    rows = []
    for s in reports:
        at = [min(t, len(s.test_curve)) - 1 for t in show_rounds]
        rows.append([f"seed {s.seed}: w1"] + [f"{s.w_curve[i, 0]:+.2f}" for i in at])
        rows.append(
            [f"seed {s.seed}: slopes a_i"]
            + [f"{s.slopes[i].min():+.2f}…{s.slopes[i].max():+.2f}" for i in at]
        )
        rows.append([f"seed {s.seed}: test loss"] + [f"{s.test_curve[i]:.3g}" for i in at])
    return markdown_table(["round", *map(str, show_rounds)], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", default=str(DEFAULT_DATA), help="folder with FL_Dataset_Printer*_Speed*.csv"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variant", choices=list(VARIANTS), default="authors")
    parser.add_argument(
        "--show",
        type=int,
        nargs="+",
        default=[1, 10, 50, 100, 150, 200],
        help="rounds whose test loss to show",
    )
    parser.add_argument("--summary", action="store_true", help="print only the spread over seeds")
    parser.add_argument("--trace", action="store_true", help="also print w1, slopes and test loss by round")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.data)
    except FileNotFoundError as exc:
        parser.exit(2, f"{exc}\n")
    reports = diagnose(runs, args.seeds, args.variant)
    final = np.array([s.test_curve[-1] for s in reports])
    if not args.summary:
        print(report_table(reports, args.show))
    if args.trace:
        print("\n" + trace_table(reports, args.show))
    far = [s.seed for s in reports if s.far_off]
    sd = final.std(ddof=1) if len(final) > 1 else 0.0
    print(
        f"\nDitto ({args.variant}), sigmoid GLM, {len(final)} seeds: mean {final.mean():.3f} ± {sd:.3f} "
        f"(sample sd), median {np.median(final):.3f}; far off (> {FAR_OFF}): {len(far)} {far}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fit the simulated printers' stored coefficients (:mod:`sensors.sim.printer`) to the real data.

``python -m sensors.sim.printer_fit --data ../shared/data/printers`` prints the fit as JSON; the
coefficients are copied by hand into :mod:`sensors.sim.printer`, never the data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from sensors.sim.printer import SPEED_SETTINGS

#: One printer's runs: ``{setting: (layers, 3) table of speed, sigma_ax, sigma_ay}``.
Runs = dict[int, np.ndarray]


def fit_relation(root: str | Path) -> dict:
    """Fit the coefficients stored in :mod:`sensors.sim.printer` from the real data folder (never copied).

    Shared curve and per-printer (shift, scale) by least squares on the 72 run means of
    sigma_a (a grid over the curve's centre and width, linear least squares inside);
    run_sd is the RMS residual of each printer's run means, LAYER_REL the median
    within-run scatter relative to ``scale * h(v)``.
    """
    from sensors.printer_data import load_printer_runs

    runs = load_printer_runs(root, drop_first_row=False)
    printers = sorted(runs)
    v = np.array(SPEED_SETTINGS, dtype=np.float64)
    sa = {p: [np.hypot(runs[p][s][:, 1], runs[p][s][:, 2]) for s in SPEED_SETTINGS] for p in printers}
    means = np.array([[x.mean() for x in sa[p]] for p in printers])
    c, w = _curve(v, means)
    h = 1.0 / (1.0 + np.exp(-(v - c) / w))
    coef = np.linalg.lstsq(np.column_stack([np.ones_like(h), h]), means.T, rcond=None)[0]
    out: dict = {"curve_c": round(c, 2), "curve_w": round(w, 2), "printers": {}}
    rel = []
    for i, p in enumerate(printers):
        out["printers"][p], scale = _printer(runs[p], means[i], coef[:, i], h)
        rel += [x.std(ddof=1) / (scale * hv) for x, hv in zip(sa[p], h, strict=True)]
    out["layer_rel"] = round(float(np.median(rel)), 3)
    out["measured_speed"], out["speed_rel"] = _speeds(runs, printers)
    out["population"] = _population(out["printers"])
    return out


def _curve(v: np.ndarray, means: np.ndarray) -> tuple[float, float]:
    """The shared curve's centre and width with the least squared error over all printers."""
    # Grid over the curve's centre and width; per printer the affine (shift, scale) is
    # closed-form least squares, so the whole grid is a few array operations.
    cc, ww = np.meshgrid(np.arange(20.0, 90.0, 0.1), np.arange(5.0, 40.0, 0.1), indexing="ij")
    H = 1.0 / (1.0 + np.exp(-(v[None, None, :] - cc[..., None]) / ww[..., None]))  # (C, W, 12)
    Hc = H - H.mean(axis=-1, keepdims=True)
    Mc = means - means.mean(axis=-1, keepdims=True)  # (P, 12)
    slope = np.einsum("cwk,pk->cwp", Hc, Mc) / (Hc**2).sum(axis=-1)[..., None]
    sse = (Mc**2).sum() - (slope**2 * (Hc**2).sum(axis=-1)[..., None]).sum(axis=-1)
    i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
    return float(cc[i, j]), float(ww[i, j])


def _printer(runs: Runs, means: np.ndarray, coef: np.ndarray, h: np.ndarray) -> tuple[dict, float]:
    """One printer's fitted (shift, scale, run_sd, ratio), and its unrounded scale."""
    shift, scale = float(coef[0]), float(coef[1])
    resid = means - (shift + scale * h)
    ratio = float(np.mean([np.mean(runs[s][:, 2] / runs[s][:, 1]) for s in SPEED_SETTINGS]))
    fitted = {
        "shift": round(shift, 3),
        "scale": round(scale, 3),
        "run_sd": round(float(np.sqrt(np.mean(resid**2))), 3),
        "ratio": round(ratio, 3),
    }
    return fitted, scale


def _speeds(runs: dict[int, Runs], printers: list[int]) -> tuple[list[float], float]:
    """Fleet-mean measured speed per setting, and the median within-run scatter of layer speed."""
    speed = np.array([[runs[p][s][:, 0].mean() for s in SPEED_SETTINGS] for p in printers]).mean(axis=0)
    scatter = [
        runs[p][s][:, 0].std(ddof=1) / runs[p][s][:, 0].mean() for p in printers for s in SPEED_SETTINGS
    ]
    return [round(float(x), 2) for x in speed], round(float(np.median(scatter)), 3)


def _population(fit: dict) -> dict[str, tuple[float, float]]:
    """(mean, std) over the fitted printers: new simulated printers are drawn from these."""

    def pop(key, f=lambda x: x):
        return (
            round(float(np.mean([f(fit[p][key]) for p in fit])), 3),
            round(float(np.std([f(fit[p][key]) for p in fit], ddof=1)), 3),
        )

    return {
        "shift": pop("shift"),
        "scale": pop("scale"),
        "log_run_sd": pop("run_sd", np.log),
        "log_ratio": pop("ratio", np.log),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sensors.sim.printer_fit", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--data", required=True, help="folder with FL_Dataset_Printer*_Speed*.csv")
    args = ap.parse_args(argv)
    try:
        relation = fit_relation(args.data)
    except (OSError, ValueError) as exc:  # a wrong folder or a malformed file: one line, no traceback
        print(f"printer_fit: {exc}", file=sys.stderr)
        return 2
    json.dump(relation, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

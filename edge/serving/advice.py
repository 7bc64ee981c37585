"""Speed advice for a printer: the highest speed its own model keeps within a vibration budget.

PFL-DA (§6) learns each printer's relation between printing speed and vibration so that a
user can "set the printing speed at a given acceleration (thus, model precision)
constraint".  The serving model maps a layer's vibration σ_a to the speed it expects; the
advice is the highest speed it expects at a vibration within the budget, minus the
model's doubt (``margin``, the conformal half-width: the interval's conservative edge).

Advice never leaves what the model knows: only vibrations the printer was trained at
(from ``sigma_min``, the least σ_a of its training rows) count, so a printer whose every
run vibrated above the budget gets no advice; and it never exceeds ``ceiling`` (the least
of the fastest trained speed, ``[serve] max_advice`` and the printer's own
``max_velocity``; :mod:`edge.serving.moonraker` sends it).  No advice always says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edge.serving.model import ServingModel
from sensors.layers import SPEED_SCALE

#: Vibration levels the advice tries between the least trained vibration and the budget.
GRID_POINTS = 101
#: The slowest speed (mm/s) advised by default (``[serve] min_advice``): an untrained model can
#: expect 0 or a negative speed, and a velocity limit of that would stall the printer.
MIN_ADVICE = 5.0


@dataclass(frozen=True)
class Advice:
    """A speed (mm/s) to cap the printer at, or ``None`` and ``why`` not; ``capped_by`` names the
    ceiling that lowered it, if one did."""

    speed: float | None
    why: str = ""
    capped_by: str | None = None

    def to_dict(self) -> dict:
        out: dict = {"speed": self.speed}
        if self.speed is None:
            out["why"] = self.why
        if self.capped_by is not None:
            out["capped_by"] = self.capped_by
        return out


def ceilings(model: ServingModel, max_advice: float | None, printer_max: float | None) -> dict[str, float]:
    """The ceilings that hold for ``model``'s advice, by name (those known)."""
    named = {"trained": model.speed_max, "max_advice": max_advice, "printer": printer_max}
    return {k: float(v) for k, v in named.items() if v is not None and math.isfinite(v)}


def speed_advice(
    model: ServingModel,
    budget: float,
    min_advice: float = MIN_ADVICE,
    margin: float = 0.0,
    ceiling: dict[str, float] | None = None,
) -> Advice:
    """The highest speed (mm/s) ``model`` expects, less ``margin``, at a vibration within ``budget``
    it was trained at, under the least of ``ceiling`` (default: the fastest trained speed)."""
    if model.classes is not None or model.width != 1 or model.encoder is not None:
        return Advice(None, "not a printer's speed model (one vibration feature, no classes, no encoder)")
    low = 0.0 if model.sigma_min is None else max(0.0, float(model.sigma_min))
    if budget < low:
        return Advice(
            None,
            f"every layer it was trained on vibrated above the budget (least sigma_a {low:.3g} > {budget:g}):"
            " no speed it knows stays within it",
        )
    grid = np.linspace(low, budget, GRID_POINTS).reshape(-1, 1)
    speeds = model.outputs(grid)[:, 0] * SPEED_SCALE - margin
    if not np.isfinite(speeds).all():
        return Advice(None, "its answers within the budget are not finite")
    best = float(speeds.max())
    if best < min_advice:
        return Advice(None, f"the fastest speed it expects within the budget, {best:.1f} mm/s, is below "
                            f"min_advice {min_advice:g}")  # fmt: skip
    limits = ceiling if ceiling is not None else ceilings(model, None, None)
    capped_by = None
    if limits:
        name = min(limits, key=limits.__getitem__)
        if limits[name] < best:
            best, capped_by = limits[name], name
    if best < min_advice:
        return Advice(None, f"the {capped_by} ceiling {best:g} mm/s is below min_advice {min_advice:g}")
    return Advice(round(best, 3), capped_by=capped_by)


def tenths_down(speed: float) -> float:
    """``speed`` rounded down to 0.1 mm/s, as it is sent: rounding up could pass a ceiling."""
    return math.floor(speed * 10 + 1e-9) / 10


def velocity_script(speed: float) -> str:
    """The G-code line that caps the toolhead at ``speed`` mm/s (Klipper), rounded down to 0.1."""
    return f"SET_VELOCITY_LIMIT VELOCITY={tenths_down(speed):.1f}"

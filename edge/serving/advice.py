"""Speed advice for a printer: the highest speed its own model keeps within a vibration budget.

PFL-DA (§6) learns each printer's relation between printing speed and vibration so that a
user can "set the printing speed at a given acceleration (thus, model precision)
constraint".  The serving model maps a layer's vibration σ_a to the speed it expects; the
advice is the highest speed it expects anywhere in ``[0, budget]`` (for a model that rises
with σ_a, its speed at the budget; a model that does not rise never advises a speed it ties
to more vibration than the budget).

With ``[serve] apply = "moonraker"`` the advice goes to the printer when a print run's first
layer is answered (the first moment this device knows a print has started), through
Moonraker's G-code API: ``POST /printer/gcode/script?script=SET_VELOCITY_LIMIT VELOCITY=<v>``
(Klipper's cap on the toolhead velocity, mm/s).  ``dry_run`` (the default) logs the request
it would send instead.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import numpy as np

from edge.serving.model import ServingModel
from sensors.layers import SPEED_SCALE

log = logging.getLogger(__name__)

#: Vibration levels the advice tries between 0 and the budget.
GRID_POINTS = 101
#: The slowest speed (mm/s) advised by default (``[serve] min_advice``): an untrained model can
#: expect 0 or a negative speed, and a velocity limit of that would stall the printer.
MIN_ADVICE = 5.0
MOONRAKER_TIMEOUT_S = 3.0


def speed_advice(model: ServingModel, budget: float, min_advice: float = MIN_ADVICE) -> float | None:
    """The highest speed (mm/s) ``model`` expects at a vibration within ``budget``; ``None`` when it
    cannot say (a welder's model, rows of more than one feature, an answer that is not finite, or
    an expected speed below ``min_advice``, which no printer should be capped at)."""
    if model.classes is not None or model.width != 1 or model.encoder is not None:
        return None
    grid = np.linspace(0.0, budget, GRID_POINTS).reshape(-1, 1)
    speeds = model.outputs(grid)[:, 0] * SPEED_SCALE
    if not np.isfinite(speeds).all() or speeds.max() < min_advice:
        return None
    return round(float(speeds.max()), 3)


def velocity_script(speed: float) -> str:
    """The G-code line that caps the toolhead at ``speed`` mm/s (Klipper)."""
    return f"SET_VELOCITY_LIMIT VELOCITY={speed:.1f}"


@dataclass
class MoonrakerApply:
    """Sends (or, dry run, logs) the advice to Moonraker at the start of each print run."""

    url: str
    dry_run: bool = True
    api_key: str | None = None
    sent: int = 0
    would_send: int = 0
    errors: int = 0
    last: str | None = None
    last_error: str | None = None

    def request(self, script: str) -> urllib.request.Request:
        query = urllib.parse.urlencode({"script": script}, quote_via=urllib.parse.quote)
        req = urllib.request.Request(f"{self.url.rstrip('/')}/printer/gcode/script?{query}", method="POST")
        if self.api_key:
            req.add_header("X-Api-Key", self.api_key)
        return req

    def apply(self, device: str, run: str, speed: float) -> None:
        """Send ``speed`` for print run ``run``; never raises (a printer that does not answer is logged)."""
        script = velocity_script(speed)
        self.last = script
        req = self.request(script)
        if self.dry_run:
            self.would_send += 1
            log.info("%s: dry run: would send %s %s for print %s", device, req.method, req.full_url, run)
            return
        try:
            with urllib.request.urlopen(req, timeout=MOONRAKER_TIMEOUT_S) as resp:
                resp.read()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self.errors += 1
            self.last_error = str(exc)
            log.warning("%s: Moonraker at %s did not take %r: %s", device, self.url, script, exc)
            return
        self.sent += 1
        self.last_error = None
        log.info("%s: sent %r to Moonraker for print %s", device, script, run)

    def status(self) -> dict:
        return {"url": self.url, "dry_run": self.dry_run, "sent": self.sent, "would_send": self.would_send,
                "errors": self.errors, "last": self.last, "last_error": self.last_error}  # fmt: skip

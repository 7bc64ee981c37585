"""Printer context from a G-code file: its layers and speeds as a planned timeline.

For printers without Klipper (stock Marlin on an Ender fed from SD card or USB), the
file that is being printed is the best context there is.  :func:`parse_gcode` turns
its moves into a :class:`~sensors.context.timeline.Timeline`; :class:`GcodeContext`
plays that back from the moment the print started.  It drifts from the real print
(the firmware's look-ahead, heating waits, pauses it never hears about), so prefer
Moonraker where there is one; the G-code timeline also labels a recorded
accelerometer log after the fact.

What is read:

* ``G0``/``G1`` with X, Y, Z (mm) and F (feed rate in **mm/min**, modal);
  ``G90``/``G91`` absolute/relative positioning; ``G92`` sets positions; ``G4`` dwells
  (P ms or S s); ``G28`` homes to 0.  E values are parsed only to tell printing
  moves from travel (``M82``/``M83`` matter for that alone).
* Layers: slicer comments ``;LAYER:n`` (Cura) or ``;LAYER_CHANGE`` (PrusaSlicer,
  SuperSlicer, OrcaSlicer) when present; otherwise a new layer starts at the first
  extruding move at a height above the previous layer (so Z-hops on travel moves do
  not count).  Moves before the first layer (purge lines on the start script) are
  in layer ``None``, as is everything after the last extruding move.
* Time per move: a trapezoidal profile from rest to rest at ``accel_mm_s2`` (Marlin's
  default for an Ender 3 is 500 mm/s²).  This is the estimate that makes the data
  set's measured speed saturate near 44 mm/s on a small cube; junction speeds are
  ignored, which overstates time on long chains of nearly collinear moves.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sensors.context.base import ContextSample
from sensors.context.timeline import Segment, Timeline, TimelineContext

_WORD = re.compile(r"([A-Za-z])\s*([-+]?(?:\d+\.?\d*|\.\d+))")
_CURA_LAYER = re.compile(r";\s*LAYER\s*:\s*(-?\d+)", re.IGNORECASE)
_PRUSA_LAYER = re.compile(r";\s*LAYER_CHANGE\b", re.IGNORECASE)


def move_time(distance: float, speed: float, accel: float) -> float:
    """Seconds for a rest-to-rest move under a trapezoidal (or triangular) speed profile."""
    if distance <= 0:
        return 0.0
    if distance >= speed * speed / accel:
        return distance / speed + speed / accel
    return 2.0 * math.sqrt(distance / accel)


def parse_gcode(
    lines: Iterable[str],
    *,
    accel_mm_s2: float = 500.0,
    default_feed_mm_min: float = 1500.0,
    job: str | None = None,
    start: float = 0.0,
) -> Timeline:
    """Plan ``lines`` into a timeline of one segment per move (or dwell), starting at ``start``."""
    if not accel_mm_s2 > 0:
        raise ValueError(f"accel_mm_s2 must be positive, got {accel_mm_s2}")
    plan = _Planner(accel_mm_s2, default_feed_mm_min / 60.0, start)
    for raw in lines:
        code, _, comment = raw.partition(";")
        if comment:
            plan.comment(comment)
        plan.command(code)
    # Moves after the last extruding one (park, present the bed) belong to no layer.
    return Timeline(
        [
            Segment(t0, t1, lay if i <= plan.last_extrude else None, z, v, "printing", job)
            for i, (t0, t1, lay, z, v, _kind) in enumerate(plan.segs)
        ]
    )


@dataclass
class _Planner:
    """What planning a file's moves keeps between lines: position, modes, feed, clock, layer."""

    accel: float
    feed: float  # mm/s
    t: float
    pos: dict[str, float] = field(default_factory=lambda: {"X": 0.0, "Y": 0.0, "Z": 0.0, "E": 0.0})
    absolute: bool = True
    abs_e: bool = True
    layer: int | None = None
    hinted: bool = False  # the file has slicer layer comments: trust them, not Z
    layer_z: float = -math.inf
    last_extrude: int = -1  # index of the last extruding move's segment
    segs: list[tuple[float, float, int | None, float, float, str]] = field(default_factory=list)

    def comment(self, comment: str) -> None:
        """A slicer's layer comment starts that layer (and from then on Z no longer does)."""
        m = _CURA_LAYER.match(";" + comment)
        if m:
            self.hinted, self.layer = True, int(m.group(1))
        elif _PRUSA_LAYER.match(";" + comment):
            self.hinted = True
            self.layer = (self.layer + 1) if self.layer is not None else 0

    def command(self, code: str) -> None:
        """One line's command (the part before any comment)."""
        words = {k.upper(): float(v) for k, v in _WORD.findall(code.split("(")[0])}
        cmd = code.strip().split(maxsplit=1)[0].upper() if code.strip() else ""
        if cmd in ("G0", "G1", "G00", "G01"):
            self.move(words)
        elif cmd == "G4":
            dt = words.get("P", 0.0) / 1000.0 + words.get("S", 0.0)
            if dt > 0:
                self.segs.append((self.t, self.t + dt, self.layer, self.pos["Z"], 0.0, "dwell"))
                self.t += dt
        else:
            self.mode(cmd, words)

    def mode(self, cmd: str, words: dict[str, float]) -> None:
        """Positioning modes, and positions set without moving (G92, G28)."""
        if cmd in ("G90",):
            self.absolute = True
        elif cmd in ("G91",):
            self.absolute = False
        elif cmd == "M82":
            self.abs_e = True
        elif cmd == "M83":
            self.abs_e = False
        elif cmd == "G92":
            for ax in "XYZE":
                if ax in words:
                    self.pos[ax] = words[ax]
        elif cmd == "G28":
            for ax in "XYZ":
                if ax in words or not any(a in words for a in "XYZ"):
                    self.pos[ax] = 0.0

    def move(self, words: dict[str, float]) -> None:
        """A G0/G1 move: its segment, and a new layer at the first extruding move above the last."""
        pos = self.pos
        if "F" in words and words["F"] > 0:
            self.feed = words["F"] / 60.0
        new = dict(pos)
        for ax in "XYZ":
            if ax in words:
                new[ax] = words[ax] if self.absolute else pos[ax] + words[ax]
        extrudes = False
        if "E" in words:
            e = words["E"] if (self.absolute and self.abs_e) else pos["E"] + words["E"]
            extrudes = e > pos["E"] + 1e-9
            new["E"] = e
        dist = math.dist((pos["X"], pos["Y"], pos["Z"]), (new["X"], new["Y"], new["Z"]))
        if extrudes and not self.hinted and new["Z"] > self.layer_z + 1e-3 and dist > 0:
            self.layer = 0 if self.layer is None else self.layer + 1
            self.layer_z = new["Z"]
        dt = move_time(dist, self.feed, self.accel)
        if dt > 0:
            self.segs.append((self.t, self.t + dt, self.layer, new["Z"], dist / dt, "move"))
            self.t += dt
            if extrudes:
                self.last_extrude = len(self.segs) - 1
        self.pos = new


def layer_speeds(timeline: Timeline) -> dict[int, float]:
    """Trajectory length / elapsed time of each layer -- the data set's speed s."""
    length: dict[int, float] = {}
    dur: dict[int, float] = {}
    for s in timeline.segments:
        if s.layer is None:
            continue
        length[s.layer] = length.get(s.layer, 0.0) + s.speed_mm_s * (s.t1 - s.t0)
        dur[s.layer] = dur.get(s.layer, 0.0) + (s.t1 - s.t0)
    return {k: length[k] / dur[k] for k in sorted(length) if dur[k] > 0}


class GcodeContext:
    """Plays a G-code file's planned timeline from ``started_at`` on ``clock``.

    Moves outside any layer (start script, parking) read as printing with
    ``layer=None`` -- which the recorder must not mistake for Z segmentation -- so they
    are reported at the nearest layer's Z with ``layer`` set to -1.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        started_at: float,
        clock: Callable[[], float] = time.monotonic,
        accel_mm_s2: float = 500.0,
    ) -> None:
        path = Path(path)
        with path.open(encoding="utf-8", errors="replace") as fh:
            tl = parse_gcode(fh, accel_mm_s2=accel_mm_s2, job=path.name, start=started_at)
        self.timeline = Timeline(
            [
                Segment(s.t0, s.t1, -1 if s.layer is None else s.layer, s.z_mm, s.speed_mm_s, s.state, s.job)
                for s in tl.segments
            ]
        )
        self._play = TimelineContext(self.timeline, clock)

    def poll(self) -> ContextSample:
        return self._play.poll()

    def status(self) -> dict:
        return {"state": "ok", "source": "gcode", "segments": len(self.timeline)}

"""Simulated Ender printers whose per-layer vibration follows the real six-printer data.

The relation, fitted to ``FL_Dataset_Printer*_Speed*.csv`` (Chou & Okwudire 2021;
PFL-DA §4.3, Fig. 5(b)) by :func:`sensors.sim.printer_fit.fit_relation` -- rerun it with
``python -m sensors.sim.printer_fit --data ../shared/data/printers``; only the
coefficients below are stored, never the data:

* Measured speed s depends on the commanded speed v alone (the data's speed column
  is identical on all six printers: it is computed from the tool path and the
  firmware's acceleration limit, which caps it near 44 mm/s on a small cube).
  ``MEASURED_SPEED`` holds the fleet mean per setting; layers scatter by
  ``SPEED_REL`` around it.
* Vibration grows with v through one curve shared by the fleet,
  ``h(v) = 1 / (1 + exp(-(v - CURVE_C) / CURVE_W))``, and each printer sees
  ``sigma_a = shift + scale * h(v)`` (covariate shift: assembly, belt tension,
  frame) plus a per-run offset ``N(0, run_sd)`` (re-tensioning, temperature between
  prints) and per-layer noise ``N(0, LAYER_REL * scale * h(v))``.  The run-to-run
  scatter is what makes printer 5's speed-30 run vibrate less than its speed-20 one.
* The split into axes is a per-printer ratio ``sigma_ay / sigma_ax`` with a small
  per-run jitter, as measured.

Invented: the tool-path length per layer (``LAYER_PATH_MM``, chosen short to keep
simulations fast -- the relation does not depend on it), the waveform of the raw
signal (:class:`VibrationStream`: a frame resonance plus filtered noise, scaled per
layer to the relation's σ), gravity on z and a small mounting tilt.

Printers named in a fleet draw their (shift, scale, run_sd, ratio) from the
population of the six fitted printers (``POPULATION``), seeded by name;
``REAL_PRINTERS`` holds the six fitted ones themselves.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from sensors.context.timeline import Segment, Timeline

SPEED_SETTINGS = (10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120)
# ---- fitted by fit_relation() on the 72 files (all 15 layers); see the module docstring ----
#: Fleet-mean measured speed (mm/s) per setting.
MEASURED_SPEED = (9.73, 18.82, 26.43, 32.41, 36.82, 39.85, 41.78, 42.90, 43.48, 43.71, 40.93, 40.69)
#: Within-run scatter of layer speed, relative.
SPEED_REL = 0.016
#: Shared vibration curve h(v) (mm/s).
CURVE_C = 45.2
CURVE_W = 17.5
#: Layer-to-layer scatter of sigma_a relative to scale * h(v).
LAYER_REL = 0.073


@dataclass(frozen=True)
class PrinterProfile:
    """One printer's idiosyncrasies (m/s² for shift, scale and run_sd)."""

    shift: float
    scale: float
    run_sd: float
    ratio: float
    ratio_sd: float = 0.06

    def sigma_a(self, setting: float) -> float:
        """The noise-free ``sigma_a`` at commanded speed ``setting``."""
        return self.shift + self.scale * vibration_curve(setting)

    @classmethod
    def draw(cls, rng: np.random.Generator) -> PrinterProfile:
        """A new printer from the population of the six real ones."""
        p = POPULATION
        return cls(
            shift=float(np.clip(rng.normal(p["shift"][0], p["shift"][1]), 0.4, 1.4)),
            scale=float(np.clip(rng.normal(p["scale"][0], p["scale"][1]), 0.3, 1.2)),
            run_sd=float(np.exp(np.clip(rng.normal(*p["log_run_sd"]), np.log(0.01), np.log(0.12)))),
            ratio=float(np.exp(rng.normal(*p["log_ratio"]))),
        )


#: The six real printers, fitted (shift, scale, run_sd, ratio).
REAL_PRINTERS = {
    1: PrinterProfile(0.681, 0.661, 0.034, 1.033),
    2: PrinterProfile(0.742, 0.551, 0.015, 0.927),
    3: PrinterProfile(0.799, 0.674, 0.043, 1.202),
    4: PrinterProfile(0.800, 0.788, 0.035, 0.944),
    5: PrinterProfile(1.221, 0.877, 0.099, 0.626),
    6: PrinterProfile(0.940, 0.633, 0.022, 0.975),
}
#: (mean, std) over the six: new printers are drawn from these.
POPULATION = {
    "shift": (0.864, 0.195),
    "scale": (0.697, 0.117),
    "log_run_sd": (-3.368, 0.641),
    "log_ratio": (-0.068, 0.217),
}
#: Invented: tool-path length of one simulated layer (mm).
LAYER_PATH_MM = 60.0
LAYER_HEIGHT_MM = 0.2
GRAVITY = 9.80665


def vibration_curve(v: float | np.ndarray) -> float | np.ndarray:
    """Shared shape ``h(v)`` of vibration against commanded speed (0..1)."""
    return 1.0 / (1.0 + np.exp(-(np.asarray(v, dtype=np.float64) - CURVE_C) / CURVE_W))


def device_seed(name: str, seed: int = 0) -> int:
    """A stable 63-bit seed from a device name and a fleet seed."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def profile_for(name: str, seed: int = 0) -> PrinterProfile:
    """The simulated printer ``name``'s profile, drawn from the population."""
    return PrinterProfile.draw(np.random.default_rng(device_seed(name, seed)))


# ----------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class LayerPlan:
    """What one simulated layer will be: its context and the σ its raw signal carries."""

    job: str
    layer: int
    setting: int
    speed: float
    sigma_ax: float
    sigma_ay: float

    @property
    def duration(self) -> float:
        return LAYER_PATH_MM / self.speed


def job_name(setting: int) -> str:
    return f"cube15_speed{setting}.gcode"


def plan_run(
    profile: PrinterProfile, setting: int, rng: np.random.Generator, layers: int = 15
) -> list[LayerPlan]:
    """One print of a ``layers``-layer cube at commanded speed ``setting``."""
    if setting not in SPEED_SETTINGS:
        raise ValueError(f"speed setting {setting} not simulated; choose from {SPEED_SETTINGS}")
    base = MEASURED_SPEED[SPEED_SETTINGS.index(setting)]
    speed = base * (1.0 + rng.normal(0.0, SPEED_REL, layers))
    lift = profile.scale * float(vibration_curve(setting))
    run = rng.normal(0.0, profile.run_sd)
    sig = profile.shift + lift + run + rng.normal(0.0, LAYER_REL * lift, layers)
    sig = np.maximum(sig, 0.05)
    ratio = profile.ratio * math.exp(rng.normal(0.0, profile.ratio_sd))
    sx = sig / math.sqrt(1.0 + ratio**2)
    return [
        LayerPlan(job_name(setting), i, setting, float(speed[i]), float(sx[i]), float(sx[i] * ratio))
        for i in range(layers)
    ]


def plan_fleet_member(
    name: str, *, seed: int = 0, settings: tuple[int, ...] = SPEED_SETTINGS, layers: int = 15
) -> dict[int, list[LayerPlan]]:
    """Every run of simulated printer ``name``: ``{setting: [LayerPlan, ...]}``."""
    rng = np.random.default_rng(device_seed(name, seed))
    profile = PrinterProfile.draw(rng)
    return {s: plan_run(profile, s, rng, layers) for s in settings}


def simulate_layers(
    name: str,
    *,
    seed: int = 0,
    settings: tuple[int, ...] = SPEED_SETTINGS,
    layers: int = 15,
) -> dict[int, np.ndarray]:
    """The planned layer table of each run, without the raw-signal path.

    Returns ``{setting: table}`` with tables of shape ``(layers, 3)``: measured speed,
    sigma_ax, sigma_ay -- the form of the real data set.  The sensor path
    (:func:`timeline_for`, :class:`VibrationStream`, the driver and the layer recorder)
    recovers these values.
    """
    plans = plan_fleet_member(name, seed=seed, settings=settings, layers=layers)
    return {s: np.array([[p.speed, p.sigma_ax, p.sigma_ay] for p in run]) for s, run in plans.items()}


def timeline_for(runs: list[list[LayerPlan]], *, start: float = 1.0, gap_s: float = 2.0) -> Timeline:
    """The runs printed one after another, ``gap_s`` apart, as a context timeline."""
    segs: list[Segment] = []
    t = start
    for run in runs:
        for p in run:
            segs.append(
                Segment(
                    t, t + p.duration, p.layer, LAYER_HEIGHT_MM * (p.layer + 1), p.speed, "printing", p.job
                )
            )
            t += p.duration
        t += gap_s
    return Timeline(segs)


# ----------------------------------------------------------------------------- raw signal
class VibrationStream:
    """Raw three-axis acceleration (m/s²) at ``rate_hz`` for a simulated print.

    ``next(n)`` returns the next ``n`` samples; sample ``k`` is at time
    ``t0 + k / rate_hz`` on the timeline's clock.  Within each layer the x and y axes
    have exactly the planned σ (scaled per layer, so a recorder that sees the layer's
    samples recovers it); between layers the head idles with a small noise floor.
    """

    IDLE_SIGMA = 0.02

    def __init__(
        self,
        timeline: Timeline,
        sigmas: dict[tuple[str, int], tuple[float, float]],
        *,
        rate_hz: float,
        rng: np.random.Generator,
        t0: float = 0.0,
    ) -> None:
        self.timeline, self.sigmas, self.rate_hz, self.t0 = timeline, sigmas, float(rate_hz), float(t0)
        self.rng = rng
        self.k = 0
        self.resonance_hz = float(rng.uniform(35.0, 55.0))
        self.tilt = rng.normal(0.0, 0.15, 2)  # mounting tilt: gravity leaks into x and y
        self._starts = np.array([s.t0 for s in timeline.segments])
        self._chunks: dict[int, tuple[int, np.ndarray]] = {}

    def _first_k(self, t: float) -> int:
        return math.ceil((t - self.t0) * self.rate_hz - 1e-9)

    def _chunk(self, i: int) -> tuple[int, np.ndarray]:
        """Segment ``i``'s x/y samples: (first sample index, (m, 2) array)."""
        if i not in self._chunks:
            seg = self.timeline.segments[i]
            k0, k1 = self._first_k(seg.t0), self._first_k(seg.t1)
            m = max(k1 - k0, 0)
            sx, sy = self.sigmas[(seg.job or "", int(seg.layer or 0))]
            tt = (k0 + np.arange(m)) / self.rate_hz
            out = np.empty((m, 2))
            for j, sigma in enumerate((sx, sy)):
                white = self.rng.normal(size=m + 3)
                colored = np.convolve(white, [1.0, 0.7, 0.4, 0.2], mode="valid")
                x = colored + 0.8 * np.sin(
                    2 * np.pi * self.resonance_hz * tt + self.rng.uniform(0, 2 * np.pi)
                )
                x = x - x.mean()
                rms = float(np.sqrt(np.mean(x**2))) if m else 1.0
                out[:, j] = x * (sigma / max(rms, 1e-12))
            if len(self._chunks) > 8:
                self._chunks.pop(next(iter(self._chunks)))  # keep memory flat over a long fleet run
            self._chunks[i] = (k0, out)
        return self._chunks[i]

    def next(self, n: int) -> np.ndarray:
        ks = self.k + np.arange(n)
        self.k += n
        ts = self.t0 + ks / self.rate_hz
        out = np.empty((n, 3))
        out[:, :2] = self.rng.normal(0.0, self.IDLE_SIGMA, (n, 2))
        out[:, 2] = self.rng.normal(0.0, self.IDLE_SIGMA, n)
        idx = np.searchsorted(self._starts, ts, side="right") - 1
        for i in range(max(int(idx[0]), 0), int(idx[-1]) + 1) if n else ():
            seg = self.timeline.segments[int(i)]
            if seg.state != "printing":
                continue
            mask = (idx == i) & (ts < seg.t1)
            if not mask.any():
                continue
            k0, chunk = self._chunk(int(i))
            local = ks[mask] - k0
            ok = (local >= 0) & (local < len(chunk))
            rows = np.flatnonzero(mask)[ok]
            out[rows, :2] = chunk[local[ok]]
            out[rows, 2] = 0.3 * chunk[local[ok], 0]
        out[:, :2] += self.tilt * GRAVITY * 0.1
        out[:, 2] += GRAVITY
        return out


# ----------------------------------------------------------------------------- sensor path
class VirtualClock:
    """Simulated time: read by calling, moved by :meth:`advance` -- nothing sleeps."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = float(t)

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def record_runs(
    runs: list[list[LayerPlan]],
    accel_factory,
    *,
    rate_hz: float,
    rng: np.random.Generator,
    poll_s: float = 0.05,
    read_every: int = 2,
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Print ``runs`` in virtual time and record them the way a Pi does.

    ``accel_factory(stream, clock)`` returns an accelerometer source
    (:class:`sensors.accel.base.AccelSource`) whose chip produces ``stream``'s samples
    at ``rate_hz`` on ``clock`` -- e.g. the ADXL345 driver on a fake I2C bus.  A read
    that raises (a bare driver's bus error or sensor fault) counts as a faulty batch.  Each step moves the clock by
    ``poll_s`` and polls the simulated context; every ``read_every`` steps the
    accelerometer is read (its FIFO must not fill in between: 33 entries are 165 ms at
    200 Hz).  Both feed a :class:`~sensors.context.recorder.LayerRecorder`.  The
    context poll sets how sharp layer boundaries are; reads cost far more than polls.

    Returns the recorded layer table per job and the recorder's drop counts.
    """
    from sensors.context.recorder import LayerRecorder
    from sensors.context.timeline import TimelineContext

    timeline = timeline_for(runs)
    sigmas = {(p.job, p.layer): (p.sigma_ax, p.sigma_ay) for run in runs for p in run}
    clock = VirtualClock(0.0)
    # A chip measuring from t = 0 has its k-th sample ready at (k + 1) / rate.
    stream = VibrationStream(timeline, sigmas, rate_hz=rate_hz, rng=rng, t0=1.0 / rate_hz)
    accel = accel_factory(stream, clock)
    context = TimelineContext(timeline, clock)
    recorder = LayerRecorder(float(accel.rate_hz))
    accel.start()
    try:
        step = 0
        while clock.t < timeline.end + 1.0:
            clock.advance(poll_s)
            recorder.add_context(context.poll())
            step += 1
            if step % read_every == 0:
                _read_into(accel, recorder)
    finally:
        accel.close()
    recorder.flush()
    jobs = [run[0].job for run in runs if run]
    return {job: recorder.table(job) for job in jobs}, dict(recorder.dropped)


def _read_into(accel, recorder) -> None:
    """One accelerometer read into the recorder; a read that raises is a faulty (dropped) batch."""
    from sensors.accel.base import AccelBatch, SensorFault

    try:
        batch = accel.read()
    except (OSError, SensorFault):
        batch = AccelBatch.empty()  # a bare driver raises; the recorder drops the layer
        recorder.add_accel(batch, ok=False)
        return
    recorder.add_accel(batch, ok=accel.status().get("state") == "ok")

"""Raw print-head vibration windows (2 axes, 227 Hz) synthesized from the per-layer simulator.

The printer simulator (:mod:`sensors.sim.printer`) gives per layer the measured
speed and the RMS accelerations σ_ax, σ_ay in m/s².  The raw accelerometer stream
through the fake I2C bus exists (``VibrationStream`` -> ``FakeAdxl345`` ->
``Adxl345`` -> ``LayerRecorder``, which ``--simulate printer`` runs), but it yields
per-layer statistics, and at 200 Hz: neither chip has a 227 Hz rate (ADXL345 200/400
Hz, MPU-6050 1 kHz/(1+div) = 250/200 Hz).  These windows do *not* come through that
path: this module synthesizes a 227 Hz window of raw samples per layer *from those
statistics*, so a 1D-CNN has raw vibration to learn from.  What is physics and what
is invented:

* Each axis is scaled to exactly the layer's RMS σ_ax / σ_ay (the statistics the
  real data set records), so the windows agree with the per-layer simulator.  The
  values are accelerations in m/s² about the mean (no gravity, zero mean per axis).
* The spectral content is invented but plausible for a belt-driven Ender: a belt
  tooth tone at ``speed / 2 mm`` (GT2 pitch), corner pulses of a 20 mm cube at
  ``speed / 20 mm`` with three harmonics, and a per-printer frame resonance in
  35-55 Hz whose share grows with speed; white sensor noise on top.  Frequencies
  above Nyquist (113.5 Hz) alias as a real 227 Hz sampler would.

Every window carries :data:`WINDOW_SCHEMA`'s hash, as DWT feature rows carry theirs,
so a model trained on one window layout is refused on another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

from sensors.sim.printer import SPEED_SETTINGS, device_seed, simulate_layers

SCHEMA_NAME = "ioft.printer.accel_window"


@dataclass(frozen=True)
class WindowSchema:
    """What a raw vibration window means: rate, axes (in order), length and units.

    Version 2 corrected ``units`` from "g" to "m/s^2" (the data never changed: they
    always were m/s²); the hash changed with it, so window models exported under
    version 1 are refused and must be re-exported.
    """

    version: int = 2
    sample_rate: float = 227.0
    axes: tuple[str, ...] = ("x", "y")
    window: int = 256
    units: str = "m/s^2"

    def to_json(self) -> str:
        body = {"name": SCHEMA_NAME, **asdict(self), "axes": list(self.axes)}
        body["layout"] = "axis-major: row = [x_0..x_{w-1}, y_0..y_{w-1}]"
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    def schema_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @property
    def shape(self) -> tuple[int, int]:
        """One window as the model sees it: ``(axes, window)``."""
        return (len(self.axes), self.window)


WINDOW_SCHEMA = WindowSchema()


def simulate_windows(
    name: str,
    *,
    seed: int = 0,
    settings: tuple[int, ...] = SPEED_SETTINGS,
    layers: int = 15,
    schema: WindowSchema = WINDOW_SCHEMA,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One raw window per simulated layer of printer ``name``.

    Returns
    -------
    windows
        ``(n, axes, window)`` float32 accelerations.
    speed
        ``(n,)`` measured speed of each layer (mm/s).
    setting
        ``(n,)`` commanded speed setting of each layer.
    """
    runs = simulate_layers(name, seed=seed, settings=settings, layers=layers)
    rng = np.random.default_rng(device_seed(name, seed) ^ 0x5EED)
    resonance = rng.uniform(35.0, 55.0)
    t = np.arange(schema.window) / schema.sample_rate
    windows, speeds, labels = [], [], []
    for setting, table in runs.items():
        for speed, sig_x, sig_y in table:
            axes = [
                _axis(t, speed, sigma, shift, resonance, rng)
                for sigma, shift in ((sig_x, 0.0), (sig_y, np.pi / 2))
            ]
            windows.append(np.stack(axes))
            speeds.append(speed)
            labels.append(setting)
    return (
        np.asarray(windows, dtype=np.float32),
        np.asarray(speeds, dtype=np.float64),
        np.asarray(labels, dtype=np.int64),
    )


def _axis(
    t: np.ndarray, speed: float, sigma: float, phase_shift: float, resonance: float, rng: np.random.Generator
) -> np.ndarray:
    """One axis of a layer's window: corner, belt and frame tones plus noise, scaled to ``sigma``."""
    phase = rng.uniform(0, 2 * np.pi, size=5)
    corner = speed / 20.0
    belt = speed / 2.0
    share = (speed / 45.0) ** 2
    sig = (
        sum(np.sin(2 * np.pi * k * corner * t + phase[k - 1] + phase_shift) / k for k in (1, 2, 3))
        + 0.6 * np.sin(2 * np.pi * belt * t + phase[3])
        + share * np.sin(2 * np.pi * resonance * t + phase[4])
        + 0.3 * rng.normal(size=t.size)
    )
    sig = sig - sig.mean()
    sig *= sigma / max(np.sqrt(np.mean(sig**2)), 1e-12)
    return sig + rng.normal(0.0, 0.002, size=t.size)

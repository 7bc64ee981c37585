"""Simulated Ender printers: per-layer (speed, sigma_ax, sigma_ay) like PFL-DA Fig. 5(b).

Physics and invention, separately:

* Measured speed saturates with the commanded speed because the firmware's
  acceleration limit stops the head reaching its set feed rate on a 20 mm cube;
  ``MEASURED_SPEED`` is the fleet mean read off the real data set (it is the same
  on all six printers).
* Vibration grows with speed through one curve shared by the fleet:
  ``speed = S_MAX * sigmoid(K * (u - C))`` in a domain-invariant vibration ``u``.
  Each printer sees ``sigma_a = scale * u + shift`` (covariate shift: assembly,
  belt tension, frame stiffness), plus a small concept shift in ``S_MAX``.
  ``K``, ``C`` and the ranges of scale/shift are fitted by eye to the real data.
* The split of sigma_a into x and y axes by a per-printer angle is invented.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

SPEED_SETTINGS = (10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120)
#: Fleet-mean measured speed per setting, from the real six-printer data.
MEASURED_SPEED = (9.7, 18.8, 26.4, 32.4, 36.8, 39.8, 41.8, 42.9, 43.5, 43.7, 40.9, 40.7)
S_MAX = 45.0
K = 8.08
C = 0.948


def device_seed(name: str, seed: int = 0) -> int:
    """A stable 63-bit seed from a device name and a fleet seed."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class PrinterProfile:
    """One printer's idiosyncrasies."""

    scale: float
    shift: float
    s_max: float
    angle: float
    noise: float

    @classmethod
    def draw(cls, rng: np.random.Generator) -> PrinterProfile:
        return cls(
            scale=float(rng.uniform(0.8, 1.3)),
            shift=float(rng.uniform(-0.1, 0.5)),
            s_max=float(S_MAX * rng.uniform(0.95, 1.05)),
            angle=float(rng.uniform(np.deg2rad(35), np.deg2rad(55))),
            noise=float(rng.uniform(0.01, 0.03)),
        )


def simulate_layers(
    name: str,
    *,
    seed: int = 0,
    settings: tuple[int, ...] = SPEED_SETTINGS,
    layers: int = 15,
) -> dict[int, np.ndarray]:
    """Simulate one printer printing a ``layers``-layer cube at each speed setting.

    Returns ``{setting: table}`` with tables of shape ``(layers, 3)``: measured speed,
    sigma_ax, sigma_ay -- the same form as the real data set.
    """
    rng = np.random.default_rng(device_seed(name, seed))
    prof = PrinterProfile.draw(rng)
    measured = dict(zip(SPEED_SETTINGS, MEASURED_SPEED, strict=True))
    runs: dict[int, np.ndarray] = {}
    for setting in settings:
        if setting not in measured:
            raise ValueError(f"speed setting {setting} not simulated; choose from {SPEED_SETTINGS}")
        speed = measured[setting] + rng.normal(0.0, 0.3, layers)
        frac = np.clip(speed / prof.s_max, 1e-3, 1 - 1e-3)
        u = C + np.log(frac / (1 - frac)) / K
        sig = prof.scale * u + prof.shift + rng.normal(0.0, prof.noise, layers)
        sig = np.maximum(sig, 1e-3)
        runs[setting] = np.column_stack([speed, sig * np.cos(prof.angle), sig * np.sin(prof.angle)])
    return runs

"""``edge-recorder --simulate printer``: the real printer recorder before the chip arrives.

The recorder, its ADXL345 driver, its Moonraker client and its dataset writer are the ones a
real printer runs; only the ends are simulated (:mod:`sensors.sim.printer_host`): the chip sits
on a fake I2C bus whose FIFO plays a simulated print's vibration, and a Moonraker on loopback
answers from the same print's timeline.  The print is ``layers`` layers of ``layer_s`` seconds on
the real clock; layer ``i`` runs at ``30 + i`` mm/s, so the stored rows are easy to check.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from edge.config import SensorsConfig
from edge.recording.base import RecorderError
from edge.recording.printer import PrinterRecorder
from sensors.sim.printer_host import FakeMoonraker, fake_printer_bus, short_timeline

log = logging.getLogger(__name__)

SIMULATED_KINDS = ("printer",)
"""What ``--simulate`` can stand in for."""

DEFAULT_SENSORS = SensorsConfig(kind="printer", poll_s=0.1, split="layer", test_fraction=0.25)
"""The ``[sensors]`` table used when no config is given."""


class SimulatedPrinter:
    """A simulated print on the real clock: a loopback Moonraker and a fake-bus ADXL345 that play it.

    Parameters
    ----------
    layers
        Layers in the print (>= 1).
    layer_s
        Seconds per layer (> 0).
    lead_s
        The print starts this long after construction, so the recorder is listening for layer 0.
    settle_s
        :meth:`finished` turns true this long after the last layer, once the recorder has seen the
        print end and stored the last layer.
    """

    def __init__(self, layers: int, layer_s: float, *, lead_s: float = 1.0, settle_s: float = 1.0) -> None:
        if layers < 1 or not layer_s > 0:
            raise RecorderError(f"--layers must be >= 1 and --layer-s > 0, got {layers} and {layer_s}")
        self.clock = time.monotonic
        start = self.clock() + lead_s
        self.timeline, self.sigmas = short_timeline(start, layers=layers, dur=layer_s, job="simulated.gcode")
        self.settle_s = settle_s
        self.chip, self.bus = fake_printer_bus(self.timeline, self.sigmas, self.clock, t0=self.clock())
        self.moonraker = FakeMoonraker(self.timeline, self.clock)

    def recorder(self, device: str, state_dir: Path, cfg: SensorsConfig | None = None) -> PrinterRecorder:
        """The real printer recorder, reading this simulation's chip and Moonraker.

        Parameters
        ----------
        device
            The device id the dataset is recorded for.
        state_dir
            Where the dataset is written.
        cfg
            A ``[sensors]`` table to take the split, polling and row limit from (its chip,
            bus and Moonraker address are replaced by the simulation's); default
            :data:`DEFAULT_SENSORS`.

        Raises
        ------
        RecorderError
            ``cfg`` describes a welder.
        """
        cfg = cfg or DEFAULT_SENSORS
        if cfg.kind != "printer":
            raise RecorderError(
                f"--simulate printer needs a printer [sensors] table, not kind = {cfg.kind!r}"
            )
        cfg = dataclasses.replace(cfg, accel="adxl345", context="moonraker", moonraker_url=self.moonraker.url)
        return PrinterRecorder(device, state_dir, cfg, clock=self.clock, bus_factory=lambda _n: self.bus)

    def finished(self) -> bool:
        """Whether the print is over (and ``settle_s`` has passed since)."""
        return self.clock() >= self.timeline.end + self.settle_s

    def close(self) -> None:
        """Stop the simulated Moonraker."""
        self.moonraker.close()

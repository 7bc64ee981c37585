"""Shared pieces of the edge-recorder tests: a Moonraker on loopback that plays a timeline,
and a simulated printer (vibration stream on a fake ADXL345) for the same timeline -- both
from :mod:`sensors.sim.printer_host`, where ``edge-recorder --simulate printer`` finds them.

Also runnable as a process (``python -m tests.sensors.recorder_helpers URL START STATE_DIR``):
a printer recorder on the real clock with the fake chip, stopped by SIGTERM like the CLI.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sensors.sim.printer_host import (  # noqa: F401 -- the tests import them from here
    RATE_HZ,
    FakeMoonraker,
    LoopbackHttp,
    fake_printer_bus,
    moonraker_body,
    short_timeline,
)


def _child(url: str, start: float, state_dir: str) -> None:
    """A printer recorder on the real clock, fake chip, real HTTP; stops on SIGTERM."""
    import logging
    import time

    from edge.config import SensorsConfig
    from edge.recording.cli import run_until_signalled
    from edge.recording.printer import PrinterRecorder

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    timeline, sigmas = short_timeline(start)
    _, bus = fake_printer_bus(timeline, sigmas, time.monotonic, t0=time.monotonic())
    cfg = SensorsConfig(kind="printer", moonraker_url=url, poll_s=0.05, test_fraction=0.25, split="layer")
    recorder = PrinterRecorder("printer7", Path(state_dir), cfg, bus_factory=lambda n: bus)
    print("ready", flush=True)
    run_until_signalled(recorder)


if __name__ == "__main__":
    _child(sys.argv[1], float(sys.argv[2]), sys.argv[3])

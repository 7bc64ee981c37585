"""``edge-recorder --simulate printer|welder``: the real recorders before the hardware arrives.

The recorder, its ADXL345 driver, its Moonraker client and its dataset writer are the ones a
real printer runs; only the ends are simulated (:mod:`sensors.sim.printer_host`): the chip sits
on a fake I2C bus whose FIFO plays a simulated print's vibration, and a Moonraker on loopback
answers from the same print's timeline.  The print is ``layers`` layers of ``layer_s`` seconds on
the real clock; layer ``i`` runs at ``30 + i`` mm/s, so the stored rows are easy to check
(``edge-trainer --simulate printer`` records on its seeded machine's own layers instead:
:func:`edge.simulated.live_printer_plan`).

The welder (:class:`SimulatedWelder`) is the real welder recorder on a watched folder that a
thread fills the way a weld monitor exports: one simulated weld (FTL-TP group M, NPY + sidecar +
``.done`` marker) every ``weld_s`` seconds, its tool condition appended to the maintenance log
at once, except every fourth weld, which the log never labels (it is answered, never stored).

A **wearing tool** (``wear_from``) and a **lagging log** (``label_lag_h``) make alerts, field
accuracy and drift visible.  What is invented, and only plausible: the tool is new (class
TC1: horn and anvil new) until weld ``wear_from``, then each weld comes out worn (TC4: both
worn) with a probability rising linearly to 1 over ``wear_welds`` welds, so the answers'
P(TC4) drifts up weld by weld (the weld physics knows only "new" and "worn" states, not a
continuous wear); the simulated clock advances ``sim_weld_min`` minutes per weld
(independent of the real ``weld_s``), and every weld's true class is written to the
maintenance log ``label_lag_h`` simulated hours after it, so labels land several welds late
(the last ones not before the run ends).  Real horns wear over thousands of welds and the
log is kept by a person; nothing here is calibrated to either.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from edge.config import SensorsConfig
from edge.recording.base import RecorderError
from edge.recording.printer import PRINTER_SOURCE, PrinterRecorder
from edge.recording.welder import WELDER_SOURCE, WelderRecorder
from sensors.sim.printer_host import FakeMoonraker, fake_printer_bus, short_timeline

if TYPE_CHECKING:
    from sensors.welding.recording import WeldRecording

log = logging.getLogger(__name__)

SIMULATED_KINDS = ("printer", "welder")
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
    plan, job
        Each layer's ``(speed, sigma_ax, sigma_ay)`` and the print's file name (default: the ramp
        above; :func:`edge.simulated.live_printer_plan`: a simulated machine's own).
    """

    def __init__(
        self,
        layers: int,
        layer_s: float,
        *,
        lead_s: float = 1.0,
        settle_s: float = 1.0,
        plan: Sequence[tuple[float, float, float]] | None = None,
        job: str = "simulated.gcode",
    ) -> None:
        if layers < 1 or not layer_s > 0:
            raise RecorderError(f"--layers must be >= 1 and --layer-s > 0, got {layers} and {layer_s}")
        self.clock = time.monotonic
        start = self.clock() + lead_s
        self.timeline, self.sigmas = short_timeline(start, layers=layers, dur=layer_s, job=job, plan=plan)
        self.settle_s = settle_s
        self.chip, self.bus = fake_printer_bus(self.timeline, self.sigmas, self.clock, t0=self.clock())
        self.moonraker = FakeMoonraker(self.timeline, self.clock)

    def recorder(
        self,
        device: str,
        state_dir: Path,
        cfg: SensorsConfig | None = None,
        source: str = PRINTER_SOURCE,
    ) -> PrinterRecorder:
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
        source
            The rows' tag in the dataset (:class:`LiveSimulation`: the trainer's simulated one).

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
        return PrinterRecorder(
            device, state_dir, cfg, clock=self.clock, bus_factory=lambda _n: self.bus, source=source
        )

    def finished(self) -> bool:
        """Whether the print is over (and ``settle_s`` has passed since)."""
        return self.clock() >= self.timeline.end + self.settle_s

    def close(self) -> None:
        """Stop the simulated Moonraker."""
        self.moonraker.close()


@dataclass(frozen=True)
class SimulatedWeld:
    """One simulated weld: its index in the run, its true tool class, and what the log writes with it."""

    index: int
    tool: str  # TC1 (new) .. TC4 (horn and anvil worn)
    material: str
    recording: WeldRecording
    landed: list[dict[str, str]]  # maintenance-log entries (earlier welds' labels) written as it is made


class SimulatedWelder:
    """Simulated welds exported into a watched folder on the real clock, with their maintenance log.

    Parameters
    ----------
    device
        Seeds the welds (and picks the device's material pair, as ``[data] source = "simulate-welder"``).
    state_dir
        The folder ``weld-inbox/`` and ``maintenance.jsonl`` are written in.
    welds
        Welds to export (>= 1); every fourth one is never labelled.
    weld_s
        Seconds between welds (> 0).
    lead_s
        The first weld is exported this long after :meth:`start`, so the recorder is watching.
    wear_from, wear_welds
        A wearing tool (see the module docstring): new before weld ``wear_from``, worn for sure
        ``wear_welds`` welds later; every weld is labelled.  ``None``: the four classes in turn.
    label_lag_h, sim_weld_min
        Labels land ``label_lag_h`` simulated hours after their weld; the simulated clock runs
        ``sim_weld_min`` minutes per weld (default: ``weld_s``, the real spacing).
    keep
        Keep only the files of the last ``keep`` welds in the folder (``None``: all): a weld is
        ~0.9 MB, so an endless run would fill the disk; the older ones were long since read.
    """

    def __init__(
        self,
        device: str,
        state_dir: Path,
        welds: int,
        weld_s: float,
        *,
        lead_s: float = 1.0,
        wear_from: int | None = None,
        wear_welds: int = 10,
        label_lag_h: float = 0.0,
        sim_weld_min: float | None = None,
        keep: int | None = None,
    ) -> None:
        if welds < 1 or not weld_s > 0:
            raise RecorderError(f"--welds must be >= 1 and --weld-s > 0, got {welds} and {weld_s}")
        if (wear_from is not None and wear_from < 0) or wear_welds < 1:
            raise RecorderError(
                f"--wear-from must be >= 0 and --wear-welds >= 1, got {wear_from} and {wear_welds}"
            )
        if not label_lag_h >= 0 or (sim_weld_min is not None and not sim_weld_min > 0):
            raise RecorderError(
                f"--label-lag-h must be >= 0 and --sim-weld-min > 0, got {label_lag_h} and {sim_weld_min}"
            )
        self.device, self.welds, self.weld_s, self.lead_s = device, welds, weld_s, lead_s
        self.wear_from, self.wear_welds = wear_from, wear_welds
        self.label_lag = timedelta(hours=label_lag_h)
        self.sim_step = timedelta(minutes=sim_weld_min) if sim_weld_min else timedelta(seconds=weld_s)
        self.labels_written = 0
        self.keep = keep
        self._exported_ids: deque[str] = deque()
        self.inbox = Path(state_dir) / "weld-inbox"
        self.label_log = Path(state_dir) / "maintenance.jsonl"
        self.exported = 0
        self._recorder: WelderRecorder | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._export, name="simulated-welder", daemon=True)

    def sensors(self, cfg: SensorsConfig | None = None) -> SensorsConfig:
        """A welder ``[sensors]`` table on this simulation's folder and log (split and limits from ``cfg``)."""
        base = cfg if cfg is not None and cfg.kind == "welder" else None
        if cfg is not None and base is None:
            raise RecorderError(f"--simulate welder needs a welder [sensors] table, not kind = {cfg.kind!r}")
        return dataclasses.replace(
            base or SensorsConfig(kind="welder", weld_folder="-", label_log="-.jsonl", test_fraction=0.25),
            weld_folder=str(self.inbox),
            label_log=str(self.label_log),
            target="tool_m",
            poll_s=0.02,
        )

    def recorder(
        self, state_dir: Path, cfg: SensorsConfig | None = None, source: str = WELDER_SOURCE
    ) -> WelderRecorder:
        """The real welder recorder, watching this simulation's folder (``source``: as the printer's)."""
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.label_log.touch()
        self._recorder = WelderRecorder(self.device, state_dir, self.sensors(cfg), source=source)
        return self._recorder

    def start(self) -> None:
        self._thread.start()

    def weld_run(self, run: str, start: datetime) -> Iterator[SimulatedWeld]:
        """The welds of one run, in order, with the log entries that land as each is made.

        Off the real clock (the export thread paces them), so ``make demo`` can replay the same
        wearing tool and lagging log in memory.  ``run`` names the run (its weld ids, its wear
        draws); ``start`` is the first weld's simulated time.
        """
        from sensors.sim.welder import GROUP_M_CLASSES, GROUP_M_DOMAINS, WeldCondition, simulate_weld
        from trainer_lite.client import derive_rng

        rng = derive_rng(0, self.device, "welds")
        material, weld_time = GROUP_M_DOMAINS[int(rng.integers(len(GROUP_M_DOMAINS)))]
        wear_rng = derive_rng(0, self.device, "wear", run)
        due: deque[tuple[datetime, dict[str, str]]] = deque()  # labels the log has not written yet
        for i in range(self.welds):
            if self.wear_from is None:
                name, (horn, anvil) = GROUP_M_CLASSES[i % len(GROUP_M_CLASSES)]
            else:
                p_worn = min(1.0, max(0.0, (i - self.wear_from + 1) / self.wear_welds))
                name, (horn, anvil) = GROUP_M_CLASSES[-1 if wear_rng.random() < p_worn else 0]
            at = start + self.sim_step * i
            rec = simulate_weld(
                WeldCondition(horn, anvil, "clean", material, weld_time),
                derive_rng(0, self.device, "weld", run, i),
                time_scale=0.3,
                weld_id=f"{self.device}-{run}-{i:03d}",
                started_at=at,
            )
            if self.wear_from is not None or i % 4 != 3:  # else: waits for a label forever
                due.append((at + self.label_lag, {"weld_id": rec.weld_id, "tool": name, "surface": "clean"}))
            landed = []  # the labels whose (simulated) time has come
            while due and due[0][0] <= at:
                landed.append(due.popleft()[1])
            yield SimulatedWeld(i, name, material, rec, landed)

    def _export(self) -> None:
        from sensors.welding.formats import write_weld_file

        start = datetime.now(UTC)
        run = start.strftime("%Y%m%dT%H%M%S%f")  # each run's welds are new ones (the ledger skips repeats)
        if self._stop.wait(self.lead_s):
            return
        began = time.monotonic()
        for weld in self.weld_run(run, start):
            with open(self.label_log, "a") as f:
                for entry in weld.landed:
                    f.write(json.dumps(entry) + "\n")
                    self.labels_written += 1
            path = write_weld_file(weld.recording, self.inbox / f"{weld.recording.weld_id}.npy")
            path.with_name(path.name + ".done").touch()
            self.exported += 1
            self._prune(weld.recording.weld_id)
            if self._stop.wait(max(0.0, self.weld_s - (time.monotonic() - began))):
                return
            began = time.monotonic()

    def _prune(self, weld_id: str) -> None:
        """Delete the files of the weld ``keep`` welds before ``weld_id`` (data, sidecar, marker)."""
        if self.keep is None:
            return
        self._exported_ids.append(weld_id)
        while len(self._exported_ids) > self.keep:
            for part in self.inbox.glob(f"{self._exported_ids.popleft()}.*"):
                part.unlink(missing_ok=True)

    def finished(self) -> bool:
        """Whether every weld was exported and the recorder has picked each one up."""
        rec = self._recorder
        if self.exported < self.welds or rec is None:
            return False
        stats = rec.source.stats
        return stats.delivered + stats.rejected >= self.welds

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

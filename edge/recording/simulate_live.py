"""The simulated machines' flags and their live run inside ``edge-trainer --simulate printer|welder``.

:class:`LiveSimulation` runs :mod:`edge.recording.simulate`'s printer or welder, and the real
recorder on it, on a thread of the trainer; :func:`add_arguments` and :func:`simulated_toml` are
what ``edge-recorder --simulate`` and ``edge-trainer --simulate`` share on their command lines.
"""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path

from edge.recording.base import RecorderError
from edge.recording.simulate import SIMULATED_KINDS, SimulatedPrinter, SimulatedWelder
from edge.simulated import live_printer_plan

log = logging.getLogger(__name__)


def simulated_toml(raw: dict, kind: str) -> dict:
    """A device TOML's dict for ``--simulate kind``: a welder ``[sensors]`` table needs no folder or log.

    The simulation supplies its own (:meth:`SimulatedWelder.sensors`), so ``weld_folder`` and
    ``label_log``, required of a real welder, default to placeholders here.
    """
    sensors = raw.get("sensors")
    if kind == "welder" and isinstance(sensors, dict) and sensors.get("kind") == "welder":
        sensors.setdefault("weld_folder", "-")
        sensors.setdefault("label_log", "-.jsonl")
    return raw


def add_arguments(p: argparse.ArgumentParser, *, trainer: bool = False) -> None:
    """The simulated machine's flags, shared by ``edge-recorder --simulate`` and ``edge-trainer --simulate``.

    The recorder stops after its print or its welds; inside the trainer (``trainer``) the printer
    prints one such print after another and the welder welds until the trainer stops.
    """
    if trainer:
        p.add_argument(
            "--no-live",
            action="store_true",
            help="with --simulate printer|welder: train on the simulated history only, recording nothing "
            "while running (a fixed, seeded dataset: what tests and benchmarks compare)",
        )
    then = "prints them again and again" if trainer else "it stops after them"
    p.add_argument(
        "--layers", type=int, default=20, help=f"with --simulate printer: layers per print; {then}"
    )
    p.add_argument("--layer-s", type=float, default=1.0, help="with --simulate printer: seconds per layer")
    _welder_arguments(p, trainer)


def _welder_arguments(p: argparse.ArgumentParser, trainer: bool) -> None:
    """The simulated welder's flags (see :func:`add_arguments`)."""
    p.add_argument(
        "--welds",
        type=int,
        default=None if trainer else 12,
        help="with --simulate welder: welds exported; "
        + ("default: until it stops" if trainer else "it stops after them"),
    )
    p.add_argument(
        "--weld-s",
        type=float,
        default=1.0 if trainer else 0.5,
        help="with --simulate welder: seconds between welds",
    )
    p.add_argument(
        "--wear-from",
        type=int,
        help="with --simulate welder: the tool starts to wear at this weld (every weld labelled; "
        "default: the four tool classes in turn)",
    )
    p.add_argument(
        "--wear-welds", type=int, default=10, help="with --wear-from: welds until the tool is worn for sure"
    )
    p.add_argument(
        "--label-lag-h",
        type=float,
        default=0.0,
        help="with --simulate welder: the maintenance log labels each weld this many simulated hours later",
    )
    p.add_argument(
        "--sim-weld-min",
        type=float,
        help="with --simulate welder: simulated minutes between welds (default: --weld-s)",
    )


#: Welds of an endless simulated welder (it stops with the trainer long before).
ENDLESS_WELDS = 10**9
#: The weld files a live simulated welder keeps in its folder (the newest; each ~0.9 MB).
KEEP_WELDS = 32


class LiveSimulation:
    """``edge-trainer --simulate printer|welder``: the simulated recorder on its own thread.

    The trainer's dataset starts as the simulated machine's seeded history
    (:mod:`edge.simulated`); this keeps recording beside it through the recorder's own path --
    the real recorder, its dataset appends, the row feed to the serving model and the
    maintenance log's labels -- so the rehearsal's devices answer, advise and alert as a
    recording machine does.  Its rows carry the history's tag (``source``), never a real one.

    Parameters
    ----------
    kind
        ``"printer"`` (one print of ``args.layers`` after another) or ``"welder"``.
    device, state_dir
        The trainer's device id and state folder.
    args
        The flags of :func:`add_arguments` (``trainer=True``).
    source
        The tag of the rows already in the dataset (``"simulate-printer"``, ``"simulate-welder"``).
    history
        The seeded history's metadata: a printer's live prints are then runs of the same simulated
        machine at its training settings (:func:`edge.simulated.live_printer_plan`), not the
        recorder's fixed ramp, so that the rehearsal's models learn one machine.
    """

    def __init__(
        self,
        kind: str,
        device: str,
        state_dir: Path,
        args: argparse.Namespace,
        source: str,
        history: dict | None = None,
    ) -> None:
        if kind not in SIMULATED_KINDS:
            raise RecorderError(f"--simulate {kind}: only {' or '.join(SIMULATED_KINDS)} record live")
        if args.layers < 1 or not args.layer_s > 0:
            raise RecorderError(
                f"--layers must be >= 1 and --layer-s > 0, got {args.layers} and {args.layer_s}"
            )
        self.kind, self.device, self.state_dir, self.args, self.source = (
            kind,
            device,
            Path(state_dir),
            args,
            source,
        )
        self.prints = 0
        self.history = history or {}
        self._stop = threading.Event()
        self._welder: SimulatedWelder | None = None
        if kind == "welder":  # its flags are checked here, before the trainer connects
            self._welder = SimulatedWelder(
                device,
                self.state_dir,
                args.welds or ENDLESS_WELDS,
                args.weld_s,
                wear_from=args.wear_from,
                wear_welds=args.wear_welds,
                label_lag_h=args.label_lag_h,
                sim_weld_min=args.sim_weld_min,
                keep=KEEP_WELDS,
            )
        self._thread = threading.Thread(target=self._run, name=f"simulated-{kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop recording (the recorder stores what it holds) and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(15.0)

    def _run(self) -> None:
        try:
            if self._welder is not None:
                self._weld(self._welder)
            else:
                while not self._stop.is_set():
                    self._print()
        except Exception:  # the trainer trains on regardless; the log says why rows stopped
            log.exception("%s: the simulated %s stopped recording", self.device, self.kind)

    def _print(self) -> None:
        planned = live_printer_plan(self.device, self.history, self.prints, self.args.layers)
        job, plan = planned if planned is not None else ("simulated.gcode", None)
        sim = SimulatedPrinter(self.args.layers, self.args.layer_s, plan=plan, job=job)
        try:
            recorder = sim.recorder(self.device, self.state_dir, source=self.source)
            self.prints += 1
            log.info(
                "simulated print %d: %d layers of %.2f s", self.prints, self.args.layers, self.args.layer_s
            )
            recorder.run(self._stop, until=sim.finished)
        finally:
            sim.close()

    def _weld(self, sim: SimulatedWelder) -> None:
        try:
            recorder = sim.recorder(self.state_dir, source=self.source)
            log.info("simulated welder: a weld every %.2f s into %s", self.args.weld_s, sim.inbox)
            sim.start()
            recorder.run(self._stop, until=sim.finished)
        finally:
            sim.close()

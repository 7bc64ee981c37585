"""``edge-recorder --device NAME --config FILE``: builds the recorder the ``[sensors]`` table asks for
and runs it until SIGTERM/SIGINT.  ``edge-recorder --simulate printer`` runs the same recorder on a
simulated printer (:mod:`edge.recording.simulate`) until its print ends.  ``edge-recorder schema
--from FOLDER --save schema.json`` infers a new sensor's feature schema from its recordings."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from edge.cli_common import device_toml, setup_logging
from edge.config import DeviceConfig
from edge.recording.base import RecorderError
from edge.recording.printer import PrinterRecorder
from edge.recording.simulate import SIMULATED_KINDS, SimulatedPrinter, SimulatedWelder
from edge.recording.simulate_live import add_arguments as add_simulation_arguments
from edge.recording.simulate_live import simulated_toml
from edge.recording.welder import WelderRecorder
from ioft_protocol.cli import entry_point
from ioft_protocol.config import build
from ioft_protocol.service import Notifier

log = logging.getLogger(__name__)


def make_recorder(config: DeviceConfig, **kwargs) -> PrinterRecorder | WelderRecorder:
    """The recorder ``config.sensors`` describes.

    Raises
    ------
    RecorderError
        No ``[sensors]`` table, a trainer configured to simulate (it would fill the same
        file), or a dataset that cannot be appended to.
    """
    cfg = config.sensors
    if cfg is None:
        raise RecorderError("the config has no [sensors] table: say what to record (see README)")
    if config.data.source != "state":
        raise RecorderError(
            f"[data] source = {config.data.source!r}: the trainer simulates its dataset; "
            "edge-recorder fills it only with [data] source = 'state' (the default)"
        )
    cls = PrinterRecorder if cfg.kind == "printer" else WelderRecorder
    return cls(config.device, Path(config.state_dir), cfg, **kwargs)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--device`` and ``--config`` are required unless ``--simulate``."""
    p = argparse.ArgumentParser(
        prog="edge-recorder",
        description="ioft device recorder: appends rows from this machine's sensors to its local dataset.",
        epilog="edge-recorder schema --from FOLDER --save schema.json: infer, show and save a new sensor's "
        'feature schema from its recordings, for [sensors] schema = "schema.json"',
    )
    p.add_argument("--device", help="this device's id, e.g. printer3 (with --simulate: default sim-printer)")
    p.add_argument(
        "--config",
        type=Path,
        help="the device's TOML config, with a [sensors] table (optional with --simulate)",
    )
    p.add_argument(
        "--state-dir",
        help="where the dataset lives (default: the config's, else /var/lib/ioft/<device>; "
        "with --simulate: ./ioft-sim/<device>, never the config's, so no real dataset gets simulated rows)",
    )
    p.add_argument(
        "--simulate",
        choices=SIMULATED_KINDS,
        help="try the real recorder before the hardware arrives: a fake I2C accelerometer and a "
        "loopback Moonraker play a simulated print (printer), or simulated welds land in a watched "
        "folder with their maintenance log (welder)",
    )
    add_simulation_arguments(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    if args.simulate is None and (args.device is None or args.config is None):
        p.error("--device and --config are required (or try it with --simulate printer)")
    return args


def schema_command(argv: list[str]) -> int:
    """``edge-recorder schema --from FOLDER [--save FILE]``: the feature schema a new sensor's recordings fit."""
    from sensors.features.infer import add_arguments, run

    p = argparse.ArgumentParser(
        prog="edge-recorder schema",
        description="infer, show and save the feature schema of a new sensor's recordings "
        "(then [sensors] schema = FILE records with it)",
    )
    add_arguments(p)
    return run(p.parse_args(argv))


@entry_point("edge-recorder", mistakes=(RecorderError,))
def main(argv: list[str] | None = None) -> int:
    """Record until SIGTERM/SIGINT (``--simulate``: until the print ends); a user mistake is one line and exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["schema"]:
        return schema_command(argv[1:])
    args = parse_args(argv)
    if args.simulate:
        return simulate(args)
    setup_logging(args.log_level, args.device)
    config = build(DeviceConfig, device_toml(args.config, args.device, args.state_dir), str(args.config))
    run_until_signalled(make_recorder(config))
    return 0


def simulate(args: argparse.Namespace) -> int:
    """``--simulate printer|welder``: the real recorder on a simulated machine, until it ends or a signal."""
    device = args.device or f"sim-{args.simulate}"
    setup_logging(args.log_level, device)
    sensors = None
    if args.config is not None:
        raw = simulated_toml(device_toml(args.config, device, None), args.simulate)
        sensors = build(DeviceConfig, raw, str(args.config)).sensors
    state_dir = Path(args.state_dir) if args.state_dir else Path("ioft-sim") / device
    if args.simulate == "welder":
        return simulate_welder(device, state_dir, sensors, args)
    sim = SimulatedPrinter(args.layers, args.layer_s)
    try:
        recorder = sim.recorder(device, state_dir, sensors)
        log.info(
            "simulated print: %d layers of %.2f s on %s; dataset in %s",
            args.layers,
            args.layer_s,
            sim.moonraker.url,
            state_dir,
        )
        run_until_signalled(recorder, until=sim.finished)
    finally:
        sim.close()
    return 0


def simulate_welder(device: str, state_dir: Path, sensors, args: argparse.Namespace) -> int:
    """``--simulate welder``: the real welder recorder on a folder a simulated welder fills."""
    sim = SimulatedWelder(
        device,
        state_dir,
        args.welds,
        args.weld_s,
        wear_from=args.wear_from,
        wear_welds=args.wear_welds,
        label_lag_h=args.label_lag_h,
        sim_weld_min=args.sim_weld_min,
    )
    try:
        recorder = sim.recorder(state_dir, sensors)
        log.info("simulated welder: %d welds every %.2f s into %s", args.welds, args.weld_s, sim.inbox)
        sim.start()
        run_until_signalled(recorder, until=sim.finished)
    finally:
        sim.close()
    return 0


def run_until_signalled(
    recorder: PrinterRecorder | WelderRecorder, until: Callable[[], bool] | None = None
) -> None:
    """Run ``recorder`` in this (main) thread until SIGTERM or SIGINT (or ``until()``), then finish cleanly."""
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("signal %d: stopping after this step", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    recorder.run(stop, until=until, notifier=Notifier.from_env())


if __name__ == "__main__":
    sys.exit(main())

"""``edge-recorder --device NAME --config FILE``: builds the recorder the ``[sensors]`` table asks for
and runs it until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from edge.cli import device_toml, setup_logging
from edge.config import DeviceConfig
from edge.recording.base import RecorderError
from edge.recording.printer import PrinterRecorder
from edge.recording.welder import WelderRecorder
from ioft_protocol.config import ConfigError, build

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
    p = argparse.ArgumentParser(
        prog="edge-recorder",
        description="ioft device recorder: appends rows from this machine's sensors to its local dataset.",
    )
    p.add_argument("--device", required=True, help="this device's id, e.g. printer3")
    p.add_argument(
        "--config", type=Path, required=True, help="the device's TOML config, with a [sensors] table"
    )
    p.add_argument(
        "--state-dir", help="where the dataset lives (default: the config's, else /var/lib/ioft/<device>)"
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level, args.device)
    try:
        config = build(DeviceConfig, device_toml(args.config, args.device, args.state_dir), str(args.config))
        recorder = make_recorder(config)
    except (ConfigError, RecorderError) as exc:
        print(f"edge-recorder: {exc}", file=sys.stderr)
        return 2
    run_until_signalled(recorder)
    return 0


def run_until_signalled(recorder: PrinterRecorder | WelderRecorder) -> None:
    """Run ``recorder`` in this (main) thread until SIGTERM or SIGINT, then finish cleanly."""
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("signal %d: stopping after this step", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    recorder.run(stop)


if __name__ == "__main__":
    sys.exit(main())

"""What ``edge-trainer`` (:mod:`edge.cli`) and ``edge-recorder`` (:mod:`edge.recording.cli`) share:
the device's TOML with the command line's overrides, and the log format.  A module of its own so
that the recorder's command line loads neither the daemon, the models nor the swarm."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from edge.config import resolve_relative_files
from ioft_protocol.config import load_toml
from sensors.files import printable


def device_toml(path: Path | None, device: str, state_dir: str | None) -> dict:
    """The device's TOML as a dict, with the command line's device and state folder
    (default ``/var/lib/ioft/<device>``); shared by ``edge-trainer`` and ``edge-recorder``."""
    raw = resolve_relative_files(load_toml(path), Path(path).parent) if path else {}
    raw["device"] = device
    if state_dir:
        raw["state_dir"] = state_dir
    elif "state_dir" not in raw:
        raw["state_dir"] = f"/var/lib/ioft/{device}"
    return raw


class OneLineFormatter(logging.Formatter):
    """A record's message always one line: a file name holding a newline (or a terminal escape)
    cannot add a forged line to the log.  A traceback, added after the message, keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)


def setup_logging(level: str, device: str) -> None:
    """Log to stderr, each line naming the device (a swarm's or a fleet's logs interleave), each
    message escaped to one line (:class:`OneLineFormatter`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(f"%(asctime)s {device} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])

"""What ``edge-trainer`` (:mod:`edge.cli`) and ``edge-recorder`` (:mod:`edge.recording.cli`) share:
the device's TOML with the command line's overrides, and the log format.  A module of its own so
that the recorder's command line loads neither the daemon, the models nor the swarm."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from edge.config import resolve_relative_files
from ioft_protocol.config import load_toml


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


def setup_logging(level: str, device: str) -> None:
    """Log to stderr, each line naming the device (a swarm's or a fleet's logs interleave)."""
    logging.basicConfig(
        level=level, format=f"%(asctime)s {device} %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )

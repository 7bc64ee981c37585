"""A device owner's opt-out: ``edge-trainer pause`` / ``resume``, without stopping the daemon.

Pausing writes ``<state_dir>/paused`` (an optional note inside); resuming removes it.
The running daemon looks for the file about once a second (:class:`PauseWatch`).  While
it is there the daemon trains and uploads nothing and reports every task as refused,
``"paused by its owner"``, in its retained status, which is how the aggregator already
learns that a device will not run a task: no round waits for it.  On resume the refusals
go, and the device answers the tasks' current rounds again.

A file rather than a message: the owner needs no broker credentials, a pause survives a
restart of the daemon (or of the Pi), and ``ls`` shows it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ioft_protocol.config import ConfigError

PAUSE_FILE = "paused"
#: What the retained status says for each task while paused (``refused: {task: REASON}``).
REASON = "paused by its owner"


def pause_reason(state_dir: Path) -> str | None:
    """``REASON`` (with the owner's note) while ``state_dir`` holds the pause file, else ``None``."""
    try:
        note = (Path(state_dir) / PAUSE_FILE).read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError:
        return REASON  # there but unreadable: paused all the same
    return f"{REASON}: {note.splitlines()[0][:200]}" if note else REASON


def pause(state_dir: Path, note: str = "") -> Path:
    """Write the pause file (atomically: a half-written note is never read); returns its path."""
    path = Path(state_dir) / PAUSE_FILE
    tmp = path.with_name(f".{PAUSE_FILE}.tmp-{os.getpid()}")
    tmp.write_text(note.strip() + "\n" if note.strip() else "")
    os.chmod(tmp, 0o644)  # the daemon's user reads it; the owner (root, via sudo) wrote it
    os.replace(tmp, path)
    return path


def resume(state_dir: Path) -> bool:
    """Remove the pause file; ``True`` if the device was paused."""
    try:
        (Path(state_dir) / PAUSE_FILE).unlink()
    except FileNotFoundError:
        return False
    return True


class PauseWatch:
    """The daemon's view of the pause file; :meth:`changed` is cheap enough for every loop turn."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self._file = os.fspath(self.state_dir / PAUSE_FILE)
        self.reason = pause_reason(self.state_dir)

    @property
    def paused(self) -> bool:
        return self.reason is not None

    def changed(self) -> bool:
        """Read the file again; ``True`` when the device was paused, resumed, or its note changed.

        Not paused and no file (nearly always): one ``stat``, no exception -- a swarm asks this of
        each of its thousands of devices every second.
        """
        if self.reason is None and not os.path.exists(self._file):
            return False
        now = pause_reason(self.state_dir)
        if now == self.reason:
            return False
        self.reason = now
        return True


# -- command line: `edge-trainer pause|resume` ------------------------------------------------------------
COMMANDS = ("pause", "resume")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("--config", type=Path, help="the device's TOML (its state_dir and device are read)")
    p.add_argument("--device", help="this device's id (default: the config's `device`)")
    p.add_argument(
        "--state-dir", help="the daemon's state folder (default: the config's, else /var/lib/ioft/<device>)"
    )
    p.add_argument("--note", default="", help="pause: why, shown beside 'paused by its owner' in the status")


def state_dir_of(raw: dict, args: argparse.Namespace) -> Path:
    """The state folder the daemon with this config uses (``ConfigError`` when none can be told)."""
    if args.state_dir:
        return Path(args.state_dir)
    if raw.get("state_dir"):
        return Path(str(raw["state_dir"]))
    device = args.device or raw.get("device")
    if not device:
        raise ConfigError(
            "command line", ["give --config (the device.toml the daemon runs with), --device or --state-dir"]
        )
    return Path(f"/var/lib/ioft/{device}")


def run(args: argparse.Namespace, raw: dict) -> int:
    """Pause or resume the device whose config is ``raw``; one line on stdout saying what happened."""
    state_dir = state_dir_of(raw, args)
    if not state_dir.is_dir():
        print(
            f"{state_dir} does not exist: is this the device's config, and has edge-trainer run once?",
            file=sys.stderr,
        )
        return 2
    if args.command == "pause":
        path = pause(state_dir, args.note)
        print(
            f"paused ({path}): the daemon stops taking part within a second, and its status says "
            f"'{REASON}'; `edge-trainer resume` undoes it"
        )
    elif resume(state_dir):
        print(f"resumed: the daemon takes part again from the current rounds ({state_dir})")
    else:
        print(f"not paused ({state_dir / PAUSE_FILE} is absent); nothing to do")
    return 0

"""What the recorder hands the trainer: every new row at once, and its status file.

:class:`RowFeed` appends the row to ``<state_dir>/serving/rows.jsonl`` (a
:class:`~edge.jsonlog.JsonLinesLog`: bounded, kill-safe) and sends one byte to the
trainer's datagram socket ``<state_dir>/serving/wake.sock`` so that it reads the line now
rather than at its next poll.  Neither may hold up recording: a failed write is logged
once and counted, a trainer that is not listening is simply not woken (it reads the feed
when it comes back, from where it stopped).

The recorder also keeps ``<state_dir>/recorder-status.json`` (:data:`STATUS_FILE`), which the
trainer's own status carries (:mod:`edge.device_status`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from pathlib import Path

from edge.jsonlog import JsonLinesLog
from edge.rows import Row

log = logging.getLogger(__name__)

#: The recorder's status (its sensors, counts and drops), written atomically in the state directory.
STATUS_FILE = "recorder-status.json"
SERVING_DIR = "serving"
FEED_FILE = "rows.jsonl"
WAKE_SOCKET = "wake.sock"
#: The feed holds at most about (keep + 1) x this: ~300 welds (13 kB a line) or ~40k layers per file.
FEED_MAX_BYTES = 4 << 20


def feed_path(state_dir: Path) -> Path:
    return Path(state_dir) / SERVING_DIR / FEED_FILE


def wake_path(state_dir: Path) -> Path:
    return Path(state_dir) / SERVING_DIR / WAKE_SOCKET


class RowFeed:
    """Rows from the recorder to the trainer's serving model (see the module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.log = JsonLinesLog(feed_path(state_dir), max_bytes=FEED_MAX_BYTES, keep=2)
        self.wake = str(wake_path(state_dir))
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.fed = 0
        self.errors = 0

    def put(self, row: Row) -> None:
        """Append ``row`` and wake the trainer; never raises (recording goes on regardless)."""
        self._put(row.to_json())

    def put_label(self, key: str, label: str) -> None:
        """The label that arrived for the earlier row ``key`` (its answer is scored: ``edge.serving.field``)."""
        self._put(json.dumps({"kind": "label", "key": key, "label": label, "time": time.time()}))

    def _put(self, line: str) -> None:
        try:
            self.log.append(line)
        except OSError as exc:
            self.errors += 1
            if self.errors == 1:
                log.error("could not feed rows to the serving model (%s); the rows are still stored", exc)
            return
        self.fed += 1
        # No trainer listening (yet), or its queue full: it reads the feed at its next poll.
        with contextlib.suppress(OSError):
            self._sock.sendto(b"\x01", self.wake)

    def close(self) -> None:
        self.log.close()
        self._sock.close()

    def status(self) -> dict:
        return {"fed": self.fed, "errors": self.errors}

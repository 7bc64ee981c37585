"""Accelerometer samples from Klipper's API server, for printers where Klipper owns the chip.

Protocol, as verified in Klipper's docs/API_Server.md and klippy source
(Klipper3d/klipper: klippy/extras/adxl345.py, klippy/extras/bulk_sensor.py,
scripts/calibrate_shaper.py) through the search tool:

* a Unix domain socket (klippy started with ``-a /tmp/klippy_uds``); each message
  either way is one JSON object terminated by the byte 0x03;
* a request ``{"id": 1, "method": "adxl345/dump_adxl345", "params": {"sensor":
  "adxl345", "response_template": {...}}}`` is answered ``{"id": 1, "result":
  {"header": ["time", "x_acceleration", "y_acceleration", "z_acceleration"]}}`` or
  ``{"id": 1, "error": {...}}``; the sensor name is the config section's last word;
* then every ~0.1 s (BATCH_UPDATES) an async message is the response template with
  ``"params"`` set to ``{"data": [[time, x, y, z], ...], "errors": n, "overflows":
  n}`` (bulk_sensor.BatchBulkHelper: ``tmp = dict(template); tmp['params'] = msg``);
* accelerations are in mm/s² (adxl345.py scales by FREEFALL_ACCEL = 9.80665 * 1000);
  ``time`` is Klipper's print time (MCU clock mapped to host), not our clock;
  ``errors`` and ``overflows`` count from the start of the subscription;
* the MPU-6050/9250 endpoint is ``mpu9250/dump_mpu9250`` (calibrate_shaper.py's
  ConfigSubscriptions), same shape.

Klipper's times are kept as given, shifted once per connection by a constant so they
sit on our clock (the recorder compares them with our printer-context times).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable

import numpy as np

from sensors.accel.base import AccelBatch, SensorFault

ENDPOINTS = {
    "adxl345": "adxl345/dump_adxl345",
    "mpu9250": "mpu9250/dump_mpu9250",
    "mpu6050": "mpu9250/dump_mpu9250",
}
TERMINATOR = b"\x03"
TEMPLATE_KEY = "ioft_accel"
#: A frame without its 0x03 after this many bytes is garbage (a 0.1 s batch at 3200 Hz is ~25 KB).
MAX_FRAME_BYTES = 1 << 20


class KlipperError(SensorFault):
    kind = "klipper"


class KlipperAccelSource:
    """An :class:`~sensors.accel.base.AccelSource` over Klipper's API socket.

    Non-blocking: ``read()`` takes what has arrived.  When Klipper goes away (EOF,
    refused connection, an error reply) the source reports a fault and reconnects with
    exponential backoff; it never raises from ``read()``.
    """

    def __init__(
        self,
        socket_path: str,
        chip: str = "adxl345",
        *,
        sensor: str | None = None,
        rate_hz: float = 3200.0,
        clock: Callable[[], float] = time.monotonic,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        if chip not in ENDPOINTS:
            raise ValueError(f"chip={chip!r}: Klipper streams one of {sorted(ENDPOINTS)}")
        self.socket_path, self.chip = socket_path, chip
        self.sensor = sensor or ("mpu9250" if chip == "mpu6050" else chip)
        self.method = ENDPOINTS[chip]
        self.rate_hz = float(rate_hz)  # Klipper's configured 'rate'; informational
        self.clock = clock
        self.backoff_s, self.max_backoff_s, self.connect_timeout_s = (
            backoff_s,
            max_backoff_s,
            connect_timeout_s,
        )
        self.sock: socket.socket | None = None
        self.buf = bytearray()
        self.state, self.reason = "stopped", ""
        self.retries = self.failures = 0
        self.dropped = self.samples = self.malformed = 0
        self.next_retry = 0.0
        self._req_id = 0
        self._sub_id: int | None = None
        self._subscribed = False
        self._offset: float | None = None
        self._errors = self._overflows = 0
        self._t_first: float | None = None
        self._last_t: float | None = None

    # ------------------------------------------------------------------ connection
    def start(self) -> None:
        self.state = "connecting"
        self._connect()

    def _connect(self) -> bool:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.connect_timeout_s)
            s.connect(self.socket_path)
            s.setblocking(False)
            self.sock, self.buf = s, bytearray()
            self._req_id += 1
            self._sub_id = self._req_id
            self._subscribed = False
            self._offset = None
            self._errors = self._overflows = 0
            req = {
                "id": self._sub_id,
                "method": self.method,
                "params": {"sensor": self.sensor, "response_template": {TEMPLATE_KEY: self.sensor}},
            }
            self._send(s, req)
        except OSError as exc:
            self._fault(f"connect {self.socket_path}: {exc}")
            return False
        self.state, self.reason = "ok", ""
        return True

    @staticmethod
    def _send(sock: socket.socket, obj: dict) -> None:
        sock.setblocking(True)
        sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + TERMINATOR)
        sock.setblocking(False)

    def _fault(self, reason: str) -> None:
        self.close_socket()
        self.failures += 1
        self.state, self.reason = "fault", reason
        self.next_retry = self.clock() + min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1))

    def close_socket(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock = None

    def close(self) -> None:
        self.close_socket()
        self.state = "stopped"

    # ------------------------------------------------------------------ data
    def _receive(self) -> None:
        """Append what the socket has to ``buf``; a closed or failed socket is a fault."""
        while self.sock is not None:
            try:
                chunk = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._fault(f"klipper socket: {exc}")
                break
            if not chunk:
                self._fault("klipper closed the connection")
                break
            self.buf += chunk

    def _frames(self) -> list:
        """Complete 0x03-terminated JSON frames taken off ``buf``; torn or oversized ones counted."""
        msgs = []
        while True:
            end = self.buf.find(TERMINATOR)
            if end < 0:
                if len(self.buf) > MAX_FRAME_BYTES:  # no terminator in sight: not Klipper talking
                    self.buf.clear()
                    self.malformed += 1
                break
            raw = bytes(self.buf[:end])
            del self.buf[: end + 1]
            try:
                msgs.append(json.loads(raw))
            except (ValueError, RecursionError):
                # A torn frame: its sample count is unknown, the next batch's times show the gap.
                self.malformed += 1
        return msgs

    def read(self) -> AccelBatch:
        if self.state == "stopped":
            return AccelBatch.empty()
        if self.sock is None:
            if self.clock() < self.next_retry:
                return AccelBatch.empty()
            self.retries += 1
            if not self._connect():
                return AccelBatch.empty()
        self._receive()
        return self.decode()

    def decode(self, data: bytes = b"") -> AccelBatch:
        """Samples from the complete frames in ``buf`` (after appending ``data``).

        What Klipper sent is untrusted input: a frame that is not JSON, not an object, or
        whose fields are not what the protocol says is skipped and counted in
        ``malformed``; rows with a non-finite value are dropped and counted. Never raises.
        """
        self.buf += data
        rows, dropped = self._rows()
        if not rows:
            self.dropped += dropped
            return AccelBatch.empty(dropped)
        return self._timed(np.concatenate(rows), dropped)

    def _rows(self) -> tuple[list[np.ndarray], int]:
        """The complete frames' sample rows, and how many samples were dropped on the way."""
        rows: list[np.ndarray] = []
        dropped = 0
        for msg in self._frames():
            if not isinstance(msg, dict):
                self.malformed += 1
                continue
            if self._sub_id is not None and msg.get("id") == self._sub_id:
                if not self._subscription_reply(msg):
                    break
                continue
            params = msg.get("params")
            if msg.get(TEMPLATE_KEY) != self.sensor or not isinstance(params, dict):
                continue  # another subscription on this connection, or not ours
            batch = _batch(params)
            if batch is None:
                self.malformed += 1
                continue
            arr, errors, overflows = batch
            # both count from the subscription's start (adxl345.py last_error_count,
            # bulk_sensor last_overflows): take the increase; an overflow event counts as one
            dropped += max(0, errors - self._errors) + max(0, overflows - self._overflows)
            self._errors, self._overflows = max(errors, self._errors), max(overflows, self._overflows)
            if not np.isfinite(arr).all():
                dropped += len(arr)  # never pass on a malformed row
            elif len(arr):  # an empty batch (only counters moved) adds no rows
                rows.append(arr)
        return rows, dropped

    def _subscription_reply(self, msg: dict) -> bool:
        """Whether Klipper accepted the subscription; a refusal is a fault, retried after the longest wait."""
        if "error" in msg:
            err = msg["error"]
            text = err.get("message", err) if isinstance(err, dict) else err
            self._fault(f"klipper refused {self.method} for sensor {self.sensor!r}: {text}")
            # a bad sensor name will not fix itself soon: back off to the max
            self.next_retry = self.clock() + self.max_backoff_s
            return False
        self._subscribed = True
        return True

    def _timed(self, arr: np.ndarray, dropped: int) -> AccelBatch:
        """Rows ``(t, x, y, z)`` on this host's clock, without any Klipper resent, in m/s²."""
        if self._offset is None:
            self._offset = self.clock() - float(arr[-1, 0])
        t = arr[:, 0] + self._offset
        if self._last_t is not None:
            keep = t > self._last_t  # after a reconnect Klipper may resend an overlap
            t, arr = t[keep], arr[keep]
        if len(t):
            self._last_t = float(t[-1])
            if self._t_first is None:
                self._t_first = float(t[0])
        self.failures = 0
        self.samples += len(t)
        self.dropped += dropped
        return AccelBatch(t, arr[:, 1:4] / 1000.0, dropped)  # mm/s² -> m/s²

    def status(self) -> dict:
        span = (
            (self._last_t - self._t_first) if self._t_first is not None and self._last_t is not None else 0.0
        )
        return {
            "state": "ok" if self.state == "ok" else ("stopped" if self.state == "stopped" else "fault"),
            "reason": self.reason,
            "retries": self.retries,
            "dropped": self.dropped,
            "malformed_frames": self.malformed,
            "chip": self.chip,
            "subscribed": self._subscribed,
            "rate_hz": self.rate_hz,
            "achieved_hz": (self.samples - 1) / span if span > 0 else 0.0,
            "next_retry_in": max(0.0, self.next_retry - self.clock()) if self.sock is None else 0.0,
        }


def _count(value: object) -> int | None:
    """A protocol counter: a non-negative int (JSON may say 3 or 3.0), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not (0 <= value < 2**53 and value == int(value)):  # NaN and inf fail the range
        return None
    return int(value)


def _batch(params: dict) -> tuple[np.ndarray, int, int] | None:
    """``(rows (n, 4), errors, overflows)`` of one batch message, ``None`` if malformed."""
    errors, overflows = _count(params.get("errors", 0)), _count(params.get("overflows", 0))
    data = params.get("data") or []
    if errors is None or overflows is None or not isinstance(data, list):
        return None
    if not data:
        return np.empty((0, 4)), errors, overflows
    try:
        arr = np.asarray(data, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):  # ragged, strings, objects, ints past float
        return None
    if arr.ndim != 2 or arr.shape[1] != 4:
        return None
    return arr, errors, overflows

"""edge-recorder with ``accel = "klipper"``: Klipper's API socket (a real Unix socket, the
bulk-sensor protocol) streams the simulated printer's vibration in real time on Klipper's
own clock, Moonraker on loopback plays the same print; one row per layer must come out."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time

import numpy as np
import pytest

from edge.config import SensorsConfig
from edge.dataset import load_dataset
from edge.recording.printer import PrinterRecorder
from sensors.sim.printer import VibrationStream
from tests.sensors.recorder_helpers import FakeMoonraker, short_timeline

RATE_HZ = 3200.0
KLIPPER_CLOCK_OFFSET = 5000.0  # Klipper's print time is not our clock: the source must realign


class RealtimeKlipper:
    """Klipper's API server for one ``adxl345/dump_adxl345`` subscription: batches every ~10 ms
    of the samples that fell due, timed on Klipper's clock, in mm/s²."""

    def __init__(self, path: str, stream: VibrationStream, t0: float) -> None:
        self.path, self.stream, self.t0 = path, stream, t0
        self.stop = threading.Event()
        self.sent = 0
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(1)
        self.srv.settimeout(0.05)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        buf = b""
        while b"\x03" not in buf:
            chunk = conn.recv(4096)
            if not chunk:
                return
            buf += chunk
        req = json.loads(buf.split(b"\x03")[0])
        assert req["method"] == "adxl345/dump_adxl345" and req["params"]["sensor"] == "adxl345"
        header = {"header": ["time", "x_acceleration", "y_acceleration", "z_acceleration"]}
        conn.sendall(json.dumps({"id": req["id"], "result": header}).encode() + b"\x03")
        while not self.stop.is_set():
            due = int((time.monotonic() - self.t0) * RATE_HZ) - self.stream.k
            if due > 0:
                ks = self.stream.k + np.arange(due)
                xyz = self.stream.next(due) * 1000.0  # m/s² -> Klipper's mm/s²
                t = self.t0 + (ks + 1) / RATE_HZ + KLIPPER_CLOCK_OFFSET
                data = np.column_stack([t, xyz]).tolist()
                msg = {
                    **req["params"]["response_template"],
                    "params": {"data": data, "errors": 0, "overflows": 0},
                }
                conn.sendall(json.dumps(msg).encode() + b"\x03")
                self.sent += due
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        self.srv.close()
        self.thread.join(timeout=2)


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="klp", dir="/tmp")  # AF_UNIX paths are short: not under tmp_path
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_recorder_on_klippers_stream_stores_one_row_per_layer(sock_dir, tmp_path):
    start = time.monotonic() + 1.0
    timeline, sigmas = short_timeline(start, layers=5)
    t0 = time.monotonic()
    stream = VibrationStream(
        timeline, sigmas, rate_hz=RATE_HZ, rng=np.random.default_rng(3), t0=t0 + 1 / RATE_HZ
    )
    klipper = RealtimeKlipper(os.path.join(sock_dir, "klippy_uds"), stream, t0)
    moonraker = FakeMoonraker(timeline, time.monotonic)
    cfg = SensorsConfig(
        kind="printer",
        accel="klipper",
        klipper_socket=klipper.path,
        rate_hz=RATE_HZ,
        moonraker_url=moonraker.url,
        poll_s=0.05,
        test_fraction=0.0,
    )
    rec = PrinterRecorder("printer8", tmp_path, cfg)
    try:
        rec.run(until=lambda: time.monotonic() > timeline.end + 0.8)
    finally:
        klipper.close()
        moonraker.close()
    loaded = load_dataset(tmp_path)
    assert loaded is not None, json.loads((tmp_path / "recorder-status.json").read_text())
    train, _, meta = loaded
    assert meta["accel"] == "klipper" and klipper.sent > 0.9 * RATE_HZ * (timeline.end - start)
    assert len(train) == 5, rec.layers.dropped
    # Layer i: 30 + i mm/s, sigmas (0.5 + 0.01 i, 0.4 + 0.01 i); ~1900 samples each, so the
    # estimate's standard error is ~1.2% and 6% is five of them.
    layer = np.arange(5)
    np.testing.assert_allclose(train.y[:, 0] * 50, 30 + layer, atol=1e-6)
    np.testing.assert_allclose(train.x[:, 0], np.hypot(0.5 + 0.01 * layer, 0.4 + 0.01 * layer), rtol=0.06)

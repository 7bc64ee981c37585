"""edge-recorder with ``accel = "klipper"``: Klipper's API socket (a real Unix socket, the
bulk-sensor protocol) streams the simulated printer's vibration in real time on Klipper's
own clock, Moonraker on loopback plays the same print; one row per layer must come out."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time

import numpy as np
import pytest

from edge.config import SensorsConfig
from edge.dataset import load_dataset
from edge.recording.printer import PrinterRecorder
from sensors.sim.printer import VibrationStream
from tests.sensors.klipper_helpers import HEADER, KlipperServer
from tests.sensors.recorder_helpers import FakeMoonraker, short_timeline

RATE_HZ = 3200.0
KLIPPER_CLOCK_OFFSET = 5000.0  # Klipper's print time is not our clock: the source must realign


class RealtimeKlipper(KlipperServer):
    """Batches every ~10 ms of the samples that fell due, timed on Klipper's clock, in mm/s²."""

    def __init__(self, path: str, stream: VibrationStream, t0: float) -> None:
        self.vibration, self.t0 = stream, t0
        self.sent = 0
        super().__init__(path)

    def stream(self, conn: socket.socket, req: dict) -> None:
        assert req["method"] == "adxl345/dump_adxl345" and req["params"]["sensor"] == "adxl345"
        self.send(conn, {"id": req["id"], "result": {"header": HEADER}})
        while not self.stop_evt.is_set():
            due = int((time.monotonic() - self.t0) * RATE_HZ) - self.vibration.k
            if due > 0:
                ks = self.vibration.k + np.arange(due)
                xyz = self.vibration.next(due) * 1000.0  # m/s² -> Klipper's mm/s²
                t = self.t0 + (ks + 1) / RATE_HZ + KLIPPER_CLOCK_OFFSET
                self.send(conn, self.batch(req, np.column_stack([t, xyz]).tolist()))
                self.sent += due
            time.sleep(0.01)

    def close(self) -> None:
        self.stop_evt.set()
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

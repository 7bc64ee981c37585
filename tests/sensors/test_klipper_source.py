"""KlipperAccelSource against a fake Klipper API server on a real Unix socket.

The server speaks the protocol of Klipper's docs/API_Server.md and
klippy/extras/bulk_sensor.py: JSON objects terminated by 0x03; the dump request is
answered with a header, then async messages are the client's response_template with
"params": {"data": [[time, x, y, z], ...], "errors": n, "overflows": n} in mm/s².
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import numpy as np
import pytest

from sensors.accel import AccelSource, KlipperAccelSource
from tests.sensors.klipper_helpers import HEADER, KlipperServer


class FakeKlipper(KlipperServer):
    """Streams a known ramp of samples: sample k is (k, -k, 9806.65) mm/s²."""

    def __init__(
        self, path: str, *, sensors=("adxl345",), rate_hz: float = 3200.0, overflows_at: int | None = None
    ):
        self.sensors, self.rate_hz = set(sensors), rate_hz
        self.overflows_at = overflows_at
        self.k = 0  # next sample index
        super().__init__(path)

    def stream(self, conn: socket.socket, req: dict) -> None:
        params = req.get("params", {})
        if req.get("method") != "adxl345/dump_adxl345" or params.get("sensor") not in self.sensors:
            err = {"error": "WebRequestError", "message": f"Unknown sensor {params.get('sensor')!r}"}
            self.send(conn, {"id": req["id"], "error": err})
            while not self.stop_evt.is_set() and conn.recv(4096):
                pass
            return
        self.send(conn, {"id": req["id"], "result": {"header": HEADER}})
        overflows = 0
        t0 = 100.0  # Klipper's print time is its own clock
        while not self.stop_evt.is_set():
            n = 32
            ks = np.arange(self.k, self.k + n)
            self.k += n
            data = [[t0 + k / self.rate_hz, float(k), float(-k), 9806.65] for k in ks]
            if self.overflows_at is not None and self.k >= self.overflows_at:
                overflows = 1
            raw = json.dumps(self.batch(req, data, 0, overflows)).encode() + b"\x03"
            # split a frame across writes: the client must reassemble on 0x03
            conn.sendall(raw[:10])
            conn.sendall(raw[10:])
            time.sleep(0.005)

    def drop(self) -> None:
        """Klipper goes away: close the client connection and stop listening."""
        self.stop_evt.set()
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.shutdown(socket.SHUT_RDWR)
        self.srv.close()
        self.thread.join(timeout=2)
        if os.path.exists(self.path):
            os.unlink(self.path)


class ManualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def collect(src, want: int, timeout: float = 5.0):
    ts, xs, dropped = [], [], 0
    deadline = time.monotonic() + timeout
    while sum(len(t) for t in ts) < want and time.monotonic() < deadline:
        b = src.read()
        ts.append(b.t)
        xs.append(b.xyz)
        dropped += b.dropped
        time.sleep(0.002)
    return np.concatenate(ts), np.concatenate(xs), dropped


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "klippy_uds")


def test_subscribes_and_streams_in_m_per_s2(sock_path):
    server = FakeKlipper(sock_path)
    src = KlipperAccelSource(sock_path, chip="adxl345")
    assert isinstance(src, AccelSource)
    try:
        src.start()
        t, xyz, dropped = collect(src, 500)
        req = server.requests[0]
        assert req["method"] == "adxl345/dump_adxl345" and req["params"]["sensor"] == "adxl345"
        assert "response_template" in req["params"]
        assert len(t) >= 500 and dropped == 0 and src.status()["subscribed"]
        k = np.arange(len(t))
        np.testing.assert_allclose(xyz[:, 0], k / 1000.0)  # mm/s² -> m/s², in order, none missing
        np.testing.assert_allclose(xyz[:, 1], -k / 1000.0)
        np.testing.assert_allclose(xyz[:, 2], 9.80665)
        np.testing.assert_allclose(np.diff(t), 1 / 3200.0, rtol=1e-6)  # Klipper's spacing kept
        assert abs(t[-1] - time.monotonic()) < 1.0  # shifted onto our clock
        assert src.status()["state"] == "ok"
    finally:
        src.close()
        server.drop()


def test_overflows_reported_by_klipper_count_as_dropped(sock_path):
    server = FakeKlipper(sock_path, overflows_at=128)
    src = KlipperAccelSource(sock_path)
    try:
        src.start()
        _, _, dropped = collect(src, 400)
        assert dropped == 1 and src.status()["dropped"] == 1  # counted once, not per message
    finally:
        src.close()
        server.drop()


def test_unknown_sensor_is_a_fault_naming_it(sock_path):
    server = FakeKlipper(sock_path, sensors=("adxl345",))
    src = KlipperAccelSource(sock_path, sensor="hotend", max_backoff_s=7.0)
    try:
        src.start()
        deadline = time.monotonic() + 3
        while src.status()["state"] == "ok" and time.monotonic() < deadline:
            assert len(src.read()) == 0
            time.sleep(0.005)
        st = src.status()
        assert st["state"] == "fault" and "hotend" in st["reason"] and "Unknown sensor" in st["reason"]
        assert st["next_retry_in"] == pytest.approx(7.0, abs=0.5)
    finally:
        src.close()
        server.drop()


def test_server_going_away_faults_then_reconnects_with_backoff(sock_path):
    clock = ManualClock()
    server = FakeKlipper(sock_path)
    src = KlipperAccelSource(sock_path, clock=clock, backoff_s=0.5)
    try:
        src.start()
        t1, _, _ = collect(src, 200)
        assert len(t1) >= 200
        server.drop()  # Klipper restarts / crashes
        deadline = time.monotonic() + 3
        while src.status()["state"] == "ok" and time.monotonic() < deadline:
            src.read()
            time.sleep(0.005)
        st = src.status()
        assert st["state"] == "fault" and "closed" in st["reason"]
        # before the backoff: no reconnect attempt, the caller gets empty batches
        for _ in range(5):
            assert len(src.read()) == 0
        assert src.retries == 0
        clock.t += 0.6  # first retry: the socket is gone -> refused, backoff doubles
        src.read()
        assert src.retries == 1 and src.status()["state"] == "fault"
        assert src.status()["next_retry_in"] == pytest.approx(1.0)
        server = FakeKlipper(sock_path)  # Klipper is back
        clock.t += 1.1
        t2, x2, _ = collect(src, 100)
        assert src.retries == 2 and src.status()["state"] == "ok" and len(t2) >= 100
        assert t2[0] > t1[-1]  # still monotonic for the recorder
        np.testing.assert_allclose(x2[:, 2], 9.80665)
    finally:
        src.close()
        server.drop()


def test_no_socket_at_all_is_a_fault_not_an_exception(sock_path):
    src = KlipperAccelSource(sock_path, chip="mpu6050")
    src.start()
    assert len(src.read()) == 0
    st = src.status()
    assert st["state"] == "fault" and sock_path in st["reason"]
    assert src.method == "mpu9250/dump_mpu9250"
    src.close()

"""Moonraker context source against a real HTTP server on loopback serving canned answers."""

from __future__ import annotations

import json
import math
import threading

import pytest

from sensors.context.moonraker import QUERY, MoonrakerConfig, MoonrakerContext, MoonrakerError, parse_status
from tests.sensors.recorder_helpers import LoopbackHttp


def answer(state="printing", z=0.6, speed=3000.0, factor=1.0, layer=None, live=None, filename="cube.gcode"):
    status = {
        "gcode_move": {"speed": speed, "speed_factor": factor, "gcode_position": [10.0, 20.0, z, 5.0]},
        "print_stats": {
            "state": state,
            "filename": filename,
            "info": {"total_layer": None, "current_layer": layer},
        },
        "toolhead": {"position": [10.0, 20.0, z, 5.0]},
    }
    if live is not None:
        status["motion_report"] = {"live_velocity": live}
    return json.dumps({"result": {"eventtime": 12345.6, "status": status}}).encode()


class Canned:
    """What the fake Moonraker does next: serve a body, hang, return garbage or an HTTP error."""

    def __init__(self):
        self.mode = "ok"
        self.body = answer()
        self.paths: list[str] = []
        self.release = threading.Event()


@pytest.fixture
def server():
    canned = Canned()

    def answer(path: str) -> tuple[int, bytes] | None:
        canned.paths.append(path)
        if canned.mode == "hang":
            canned.release.wait(2.0)
            return None
        if canned.mode == "http500":
            return 500, b"klippy disconnected"
        return 200, b"<html>not json" if canned.mode == "garbage" else canned.body

    http = LoopbackHttp(answer)
    canned.url = http.url
    yield canned
    canned.release.set()
    http.close()


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_poll_reads_state_z_and_feed_rate_in_mm_per_s(server):
    ctx = MoonrakerContext(MoonrakerConfig(server.url, timeout_s=0.5), clock=Clock())
    s = ctx.poll()
    assert server.paths == [QUERY]
    assert (s.t, s.layer, s.z_mm, s.printing, s.state, s.job) == (
        100.0,
        None,
        0.6,
        True,
        "printing",
        "cube.gcode",
    )
    assert s.speed_mm_s == pytest.approx(50.0)  # F3000 mm/min
    server.body = answer(speed=3000.0, factor=1.5, layer=7)  # M220 S150
    s = ctx.poll()
    assert s.speed_mm_s == pytest.approx(75.0) and s.layer == 7
    server.body = answer(live=31.5)  # motion_report's actual speed wins over the feed rate
    assert ctx.poll().speed_mm_s == pytest.approx(31.5)
    assert ctx.status()["state"] == "ok"


@pytest.mark.parametrize("state", ["paused", "complete", "standby", "cancelled", "error"])
def test_non_printing_states_pass_through(server, state):
    server.body = answer(state=state)
    s = MoonrakerContext(MoonrakerConfig(server.url), clock=Clock()).poll()
    assert s.state == state and not s.printing


def test_garbage_and_http_errors_are_faults_then_recovery(server):
    clock = Clock()
    ctx = MoonrakerContext(
        MoonrakerConfig(server.url, timeout_s=0.5, fail_threshold=2, backoff_s=5.0), clock=clock
    )
    server.mode = "garbage"
    assert ctx.poll().state == "fault"
    assert ctx.status()["state"] == "ok"  # one failure is not yet a fault state
    server.mode = "http500"
    s = ctx.poll()
    assert s.state == "fault" and not s.printing and math.isnan(s.speed_mm_s)
    st = ctx.status()
    assert st["state"] == "fault" and st["failures"] == 2 and "500" in st["last_error"]
    # Backing off: no request until the back-off ends, even though the server is fine again.
    server.mode = "ok"
    n = len(server.paths)
    clock.t += 4.9
    assert ctx.poll().state == "fault" and len(server.paths) == n
    clock.t += 0.2
    s = ctx.poll()
    assert s.state == "printing" and len(server.paths) == n + 1
    assert ctx.status()["state"] == "ok" and ctx.failures == 0


def test_a_hung_printer_times_out_and_backs_off_doubling(server):
    clock = Clock()
    cfg = MoonrakerConfig(server.url, timeout_s=0.2, fail_threshold=1, backoff_s=1.0, backoff_max_s=3.0)
    ctx = MoonrakerContext(cfg, clock=clock)
    server.mode = "hang"
    assert ctx.poll().state == "fault"
    assert "timed out" in ctx.status()["last_error"].lower()
    assert ctx.status()["retry_at"] == pytest.approx(101.0)
    clock.t = 101.0
    ctx.poll()
    assert ctx.status()["retry_at"] == pytest.approx(103.0)  # doubled
    clock.t = 103.0
    ctx.poll()
    assert ctx.status()["retry_at"] == pytest.approx(106.0)  # capped at 3 s


def test_refused_connection_is_a_fault(server):
    ctx = MoonrakerContext(
        MoonrakerConfig("http://127.0.0.1:9", timeout_s=0.3, fail_threshold=1), clock=Clock()
    )
    assert ctx.poll().state == "fault"
    assert ctx.status()["state"] == "fault"


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b"[]",
        b'{"result": [1, 2]}',
        b'{"result": {"status": []}}',
        json.dumps({"result": {"status": {"print_stats": {"state": "exploded"}}}}).encode(),
        b"\xff\xfe",
    ],
)
def test_parse_status_rejects_wrong_shapes(body):
    with pytest.raises(MoonrakerError):
        parse_status(body, 0.0)


def _status(**objects) -> bytes:
    status = {"print_stats": {"state": "printing"}, **objects}
    return json.dumps({"result": {"eventtime": 1.0, "status": status}}).encode()


@pytest.mark.parametrize("name", ["print_stats", "gcode_move", "toolhead", "motion_report"])
@pytest.mark.parametrize("value", [1, "x", [1, 2, 3], True, 2.5])
def test_parse_status_rejects_objects_that_are_not_objects(name, value):
    """A Klipper object that is not a JSON object is MoonrakerError (was AttributeError)."""
    with pytest.raises(MoonrakerError, match=name):
        parse_status(_status(**{name: value}), 0.0)


@pytest.mark.parametrize(
    "body",
    [
        b'{"result": {"status": {"print_stats": {"state": ["printing"]}}}}',  # unhashable state
        b"[" * 100_000,  # nested too deep for the json module
    ],
)
def test_parse_status_rejects_other_malformed_bodies(body):
    with pytest.raises(MoonrakerError):
        parse_status(body, 0.0)


def test_parse_status_reads_ill_typed_fields_as_unknown():
    """Fields of the wrong type inside the objects read as missing; nothing else escapes."""
    body = (
        b'{"result": {"status": {"print_stats": {"state": "printing", "filename": [1],'
        b' "info": {"current_layer": Infinity}}, "gcode_move": {"gcode_position": [0, 0, "z"],'
        b' "speed": 1' + b"0" * 400 + b', "speed_factor": NaN}, "motion_report": {"live_velocity": "fast"},'
        b' "toolhead": null}}}'
    )
    s = parse_status(body, 2.0)
    assert s.layer is None and s.job is None and math.isnan(s.z_mm) and math.isnan(s.speed_mm_s)
    s = parse_status(_status(print_stats={"state": "printing", "info": {"current_layer": 1e300}}), 2.0)
    assert s.layer == int(1e300)


def test_poll_reports_a_malformed_body_as_a_fault_and_keeps_polling(server):
    clock = Clock()
    ctx = MoonrakerContext(MoonrakerConfig(server.url, timeout_s=0.5, fail_threshold=1), clock=clock)
    server.body = _status(gcode_move=[1, 2])
    s = ctx.poll()  # raised AttributeError out of poll() before
    assert s.state == "fault" and ctx.status()["state"] == "fault"
    assert "MoonrakerError" in ctx.status()["last_error"] and "gcode_move" in ctx.status()["last_error"]
    server.body = answer()
    clock.t += 10.0
    assert ctx.poll().state == "printing" and ctx.status()["state"] == "ok"


def test_parse_status_accepts_the_bare_payload_too():
    wrapped = json.loads(answer(layer=3))
    assert parse_status(json.dumps(wrapped["result"]).encode(), 1.0) == parse_status(answer(layer=3), 1.0)


def test_parse_status_falls_back_to_toolhead_z_and_tolerates_missing_fields():
    body = json.dumps(
        {
            "result": {
                "eventtime": 1.0,
                "status": {"print_stats": {"state": "printing"}, "toolhead": {"position": [0, 0, 1.4, 0]}},
            }
        }
    ).encode()
    s = parse_status(body, 5.0)
    assert s.z_mm == 1.4 and s.layer is None and math.isnan(s.speed_mm_s) and s.job is None


def test_config_rejects_non_http_urls():
    with pytest.raises(ValueError, match="http"):
        MoonrakerConfig("ftp://printer")


def test_moonraker_samples_drive_the_layer_recorder(server):
    """Real HTTP polls (Z only, no slicer layer numbers) through the recorder; a dead stretch drops a layer."""
    from dataclasses import dataclass

    import numpy as np

    from sensors.context.recorder import LayerRecorder

    @dataclass
    class Batch:
        t: np.ndarray
        xyz: np.ndarray
        dropped: int = 0

    clock = Clock()
    clock.t = 0.0
    ctx = MoonrakerContext(MoonrakerConfig(server.url, timeout_s=0.5, fail_threshold=5), clock=clock)
    rec = LayerRecorder(100.0)
    rng = np.random.default_rng(0)
    k = 0
    script = (
        [("standby", 0.0)] + [("printing", 0.2 * (1 + i // 20)) for i in range(100)] + [("complete", 1.0)] * 3
    )
    for i, (state, z) in enumerate(script):
        clock.t = 0.1 * (i + 1)
        server.body = answer(state=state, z=z, live=25.0)
        server.mode = "garbage" if 50 <= i < 53 else "ok"  # Moonraker babbles in layer 3 (z = 0.6)
        rec.add_context(ctx.poll())
        n = int(clock.t * 100) - k
        rec.add_accel(Batch((k + np.arange(n)) / 100.0, rng.normal(0, 0.5, (n, 3))))
        k += n
    rec.flush()
    assert [r.layer for r in rec.rows] == [0, 1, 3, 4]
    assert rec.dropped == {"context_fault": 1}  # counted once, not again when polls resume inside it
    assert all(r.speed == pytest.approx(25.0) for r in rec.rows)
    assert all(r.sigma_ax == pytest.approx(0.5, rel=0.15) for r in rec.rows)

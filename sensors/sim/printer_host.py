"""A simulated printer host for trying ``edge-recorder`` without the hardware: a Moonraker
answering over real HTTP on loopback from a print timeline, and an accelerometer on a fake
I2C bus whose FIFO plays that print's vibration.

``edge-recorder --simulate printer`` and the recorder tests use these same pieces.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from sensors.context.timeline import Segment, Timeline, TimelineContext
from sensors.sim.i2c_bus import FakeAdxl345, FakeI2cBus, FakeMpu6050
from sensors.sim.printer import VibrationStream

RATE_HZ = 200.0
"""The ADXL345's output data rate nearest to the paper's 227 Hz."""


def moonraker_body(sample) -> bytes:
    """What Moonraker's ``/printer/objects/query`` answers for a context sample.

    Parameters
    ----------
    sample
        A :class:`~sensors.context.timeline.TimelineContext` poll result.

    Returns
    -------
    bytes
        The JSON body.
    """
    z = sample.z_mm if math.isfinite(sample.z_mm) else 0.0
    status = {
        "print_stats": {
            "state": sample.state,
            "filename": sample.job or "",
            "info": {"total_layer": None, "current_layer": sample.layer},
        },
        "gcode_move": {"speed": 1500.0, "speed_factor": 1.0, "gcode_position": [10.0, 20.0, z, 1.0]},
        "toolhead": {"position": [10.0, 20.0, z, 1.0]},
        "motion_report": {"live_velocity": sample.speed_mm_s},
    }
    return json.dumps({"result": {"eventtime": sample.t, "status": status}}).encode()


class LoopbackHttp:
    """A real HTTP server on 127.0.0.1: each GET is answered by ``answer(path)``.

    ``answer`` returns ``(200, json_bytes)``, ``(status, reason)`` for an HTTP error,
    or ``None`` to send nothing (after hanging as long as it likes).
    """

    def __init__(
        self,
        answer: Callable[[str], tuple[int, bytes] | None],
        answer_post: Callable[[str], tuple[int, bytes] | None] | None = None,
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if answer_post is None:
                    self.send_error(405, "GET only")
                    return
                self._reply(answer_post(self.path))

            def do_GET(self) -> None:
                self._reply(answer(self.path))

            def _reply(self, result: tuple[int, bytes] | None) -> None:
                if result is None:
                    return
                status, body = result
                if status != 200:
                    self.send_error(status, body.decode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeMoonraker(LoopbackHttp):
    """Answers like Moonraker from a timeline played on ``clock``, keeping Klipper's limits as Klipper does.

    ``down`` makes it answer HTTP 500 ("klippy disconnected") until cleared.  G-code sent to
    ``POST /printer/gcode/script?script=...`` is kept in ``scripts`` (answered ``{"result": "ok"}``).
    ``SET_VELOCITY_LIMIT VELOCITY=<v>`` sets the live ``toolhead.max_velocity`` to ``v`` uncapped, as
    current Klipper does (``stuck``: answered ok and not applied); ``config_max_velocity`` is the
    ``[printer]`` section's (``configfile.settings.printer.max_velocity``); ``print_state``, when set,
    replaces the timeline's ``print_stats.state``.
    """

    def __init__(self, timeline: Timeline, clock: Callable[[], float], max_velocity: float = 300.0) -> None:
        self.context = TimelineContext(timeline, clock)
        self.down = False
        self.stuck = False
        self.requests = 0
        self.scripts: list[str] = []
        self.max_velocity = self.config_max_velocity = max_velocity
        self.print_state: str | None = None
        super().__init__(self._answer, self._post)

    def _post(self, path: str) -> tuple[int, bytes]:
        url = urllib.parse.urlsplit(path)
        script = urllib.parse.parse_qs(url.query).get("script")
        if url.path != "/printer/gcode/script" or not script:
            return 404, b"not found"
        if self.down:
            return 500, b"klippy disconnected"
        self.scripts.append(script[0])
        words = script[0].split()
        if words and words[0].upper() == "SET_VELOCITY_LIMIT" and not self.stuck:
            for word in words[1:]:
                name, _, value = word.partition("=")
                if name.upper() == "VELOCITY":
                    self.max_velocity = float(value)  # no cap at the config's max_velocity
        return 200, json.dumps({"result": "ok"}).encode()

    def _answer(self, path: str) -> tuple[int, bytes]:
        self.requests += 1
        if self.down:
            return 500, b"klippy disconnected"
        body = json.loads(moonraker_body(self.context.poll()))
        status = body["result"]["status"]
        status["toolhead"]["max_velocity"] = self.max_velocity
        status["configfile"] = {"settings": {"printer": {"max_velocity": self.config_max_velocity}}}
        if self.print_state is not None:
            status["print_stats"]["state"] = self.print_state
        return 200, json.dumps(body).encode()


class HungMoonraker:
    """A Moonraker that accepts connections and never answers (a wedged host): the kernel completes
    each connection from the listen backlog; nothing ever reads or writes it."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def fake_printer_bus(
    timeline: Timeline,
    sigmas: dict,
    clock: Callable[[], float],
    *,
    seed: int = 0,
    t0: float = 0.0,
    chip: str = "adxl345",
) -> tuple[FakeAdxl345 | FakeMpu6050, FakeI2cBus]:
    """A fake I2C bus holding an ADXL345 (or MPU-6050) whose FIFO plays the simulated vibration of ``timeline``.

    The chip starts measuring when the driver configures it (at ``t0`` on ``clock``), so
    its k-th sample is at ``t0 + (k + 1) / rate``.

    Parameters
    ----------
    timeline
        The print the vibration follows.
    sigmas
        ``{(job, layer): (sigma_ax, sigma_ay)}``, the vibration's planned spread per layer.
    clock
        The clock the chip's FIFO fills on.
    seed
        Seeds the vibration noise.
    t0
        When the chip starts measuring, on ``clock``.
    chip
        ``"adxl345"`` or ``"mpu6050"``.

    Returns
    -------
    tuple
        The fake chip and the bus holding it.
    """
    stream = VibrationStream(
        timeline, sigmas, rate_hz=RATE_HZ, rng=np.random.default_rng(seed), t0=t0 + 1.0 / RATE_HZ
    )
    fake = (FakeAdxl345 if chip == "adxl345" else FakeMpu6050)(stream, clock)
    return fake, FakeI2cBus(fake)


def short_timeline(
    start: float,
    *,
    layers: int = 40,
    dur: float = 0.6,
    job: str = "cube.gcode",
    plan: Sequence[tuple[float, float, float]] | None = None,
) -> tuple[Timeline, dict]:
    """A print of ``layers`` layers of ``dur`` seconds from ``start``, and its planned sigmas.

    Layer ``i`` runs at ``30 + i`` mm/s with sigmas ``(0.5 + 0.01 i, 0.4 + 0.01 i)``, or, with
    ``plan``, at ``plan[i]``'s ``(speed, sigma_ax, sigma_ay)``: a simulated machine's own layers.

    Returns
    -------
    tuple
        The timeline and ``{(job, layer): (sigma_ax, sigma_ay)}``.
    """
    segs, sigmas = [], {}
    for i in range(layers):
        t = start + i * dur
        speed, sx, sy = plan[i] if plan is not None else (30.0 + i, 0.5 + 0.01 * i, 0.4 + 0.01 * i)
        segs.append(Segment(t, t + dur, i, 0.2 * (i + 1), speed, "printing", job))
        sigmas[(job, i)] = (sx, sy)
    return Timeline(segs), sigmas

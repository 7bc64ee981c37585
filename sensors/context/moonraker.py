"""Printer context from Klipper through Moonraker's HTTP API, polled with urllib.

One request per poll::

    GET {base}/printer/objects/query?gcode_move&print_stats&toolhead&motion_report

Moonraker answers ``{"result": {"eventtime": ..., "status": {...}}}`` (Moonraker
docs, "Query printer object status"; objects it does not know are left out, not an
error).  Fields used, as Klipper defines them (klippy/extras/gcode_move.py,
print_stats.py, motion_report.py; Klipper's Status_Reference):

* ``print_stats.state``: ``standby | printing | paused | complete | cancelled | error``;
  ``print_stats.filename``; ``print_stats.info.current_layer`` -- ``null`` unless the
  slicer emits ``SET_PRINT_STATS_INFO CURRENT_LAYER=...``, so Z is the fallback.
* ``gcode_move.gcode_position[2]``: Z in G-code coordinates (mm).
* ``gcode_move.speed``: the last G-code feed rate F in **mm/min** (Klipper returns
  ``speed / speed_factor`` with ``speed_factor = 1/60``), and
  ``gcode_move.speed_factor``: the M220 override as a ratio (1.0 = 100 %).
* ``motion_report.live_velocity``: the tool head's actual speed (mm/s), when the
  object is there (Klipper ≥ 2021).  Preferred: its time average over a layer is the
  data set's "trajectory length / elapsed time"; the commanded feed rate overstates
  it wherever the acceleration limit keeps the head below F.
* ``toolhead.position`` (``[x, y, z, e]``): Z when ``gcode_move`` is missing.

A printer that stops answering (timeout, refused connection, HTTP error, garbage)
yields ``state="fault"`` samples; after ``fail_threshold`` failures in a row the
source backs off exponentially (no request until the back-off ends, so a dead host
does not cost a timeout per poll) and reports ``status()["state"] == "fault"``.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from sensors.context.base import STATES, ContextSample

log = logging.getLogger(__name__)

QUERY = "/printer/objects/query?gcode_move&print_stats&toolhead&motion_report"


class MoonrakerError(Exception):
    """A Moonraker answer we cannot use (HTTP error, not JSON, wrong shape)."""


@dataclass(frozen=True)
class MoonrakerConfig:
    """Where Moonraker is and how patiently to ask.

    Parameters
    ----------
    url
        Base URL, e.g. ``http://127.0.0.1:7125`` (Moonraker's default port).
    timeout_s
        Per-request timeout; keep it below the poll interval.
    api_key
        Sent as ``X-Api-Key`` when Moonraker requires one.
    fail_threshold
        Failures in a row before the source counts as faulted and starts backing off.
    backoff_s, backoff_max_s
        First back-off and its cap; it doubles on each failed retry.
    """

    url: str = "http://127.0.0.1:7125"
    timeout_s: float = 1.0
    api_key: str | None = None
    fail_threshold: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"moonraker url must start with http:// or https://, got {self.url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


def parse_status(body: bytes, t: float) -> ContextSample:
    """A :class:`ContextSample` from a ``/printer/objects/query`` answer.

    Raises
    ------
    MoonrakerError
        For every body that is not such an answer: not JSON, nested too deep, no
        ``status`` object, an object Klipper reports (``print_stats``, ``gcode_move``,
        ``toolhead``, ``motion_report``) that is neither an object nor ``null``, or a
        ``print_stats.state`` that is not one of Klipper's.  Fields of the wrong type
        inside those objects (a string Z, a list as file name, an infinite layer) read
        as unknown (``nan`` / ``None``), as a missing field does.
    """
    try:
        doc = json.loads(body)
        # Moonraker's HTTP replies wrap the payload in "result"; accept a bare one too
        # (the JSON-RPC docs show it so, and proxies in front of Moonraker may unwrap).
        status = doc.get("result", doc)["status"]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise MoonrakerError(f"not a Moonraker objects/query answer: {exc!r}") from None
    if not isinstance(status, dict):
        raise MoonrakerError("result.status is not an object")
    ps = _object(status, "print_stats")
    gm = _object(status, "gcode_move")
    th = _object(status, "toolhead")
    mr = _object(status, "motion_report")
    state = ps.get("state")
    if not isinstance(state, str) or state not in STATES or state == "fault":
        raise MoonrakerError(f"print_stats.state {state!r} is not one of Klipper's states")
    info = ps.get("info")
    layer = _num(info.get("current_layer")) if isinstance(info, dict) else math.nan
    layer = int(layer) if math.isfinite(layer) else None
    pos = gm.get("gcode_position")
    if not isinstance(pos, list) or len(pos) < 3:  # gcode_move missing or without a position
        pos = th.get("position")
    z = _num(pos[2]) if isinstance(pos, list) and len(pos) >= 3 else math.nan
    speed = _num(mr.get("live_velocity"))
    if not math.isfinite(speed):
        # mm/min feed rate times the M220 override, in mm/s
        speed = _num(gm.get("speed")) * _num(gm.get("speed_factor", 1.0)) / 60.0
    job = ps.get("filename")
    job = job if isinstance(job, str) and job else None
    return ContextSample(t, layer, z, speed, state == "printing", state, job)


def _object(status: dict, name: str) -> dict:
    """``status[name]`` when it is an object, ``{}`` when missing or ``null``; else MoonrakerError."""
    value = status.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MoonrakerError(f"{name} is not an object: {type(value).__name__}")
    return value


def _num(x: object) -> float:
    """A JSON number as a float; ``nan`` for anything else (bools, strings, ints past float range)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return math.nan
    try:
        return float(x)
    except OverflowError:  # an int of 400 digits
        return math.nan


class MoonrakerContext:
    """Polls Moonraker; see the module docstring for fields, faults and back-off.

    Parameters
    ----------
    config
        Where and how to ask.
    clock
        Timestamps for samples and the back-off; must be the accelerometer's clock.
    """

    def __init__(self, config: MoonrakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.failures = 0
        self.last_error: str | None = None
        self.last_ok: float | None = None
        self._retry_at = -math.inf
        self._backoff = config.backoff_s
        self.requests = 0

    def _fetch(self) -> bytes:
        req = urllib.request.Request(
            self.config.url.rstrip("/") + QUERY, headers={"Accept": "application/json"}
        )
        if self.config.api_key:
            req.add_header("X-Api-Key", self.config.api_key)
        self.requests += 1
        with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
            return resp.read(1 << 20)

    def poll(self) -> ContextSample:
        t = float(self.clock())
        if t < self._retry_at:
            return self._fault_sample(t)
        try:
            sample = parse_status(self._fetch(), t)
        except (OSError, urllib.error.URLError, MoonrakerError, ValueError) as exc:
            # OSError covers timeouts, refused connections and resets; HTTPError is a URLError.
            self._failed(t, exc)
            return self._fault_sample(t)
        if self.failures >= self.config.fail_threshold:
            log.info("moonraker at %s answers again after %d failures", self.config.url, self.failures)
        self.failures, self.last_error, self.last_ok = 0, None, t
        self._backoff, self._retry_at = self.config.backoff_s, -math.inf
        return sample

    def _failed(self, t: float, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.failures >= self.config.fail_threshold:
            self._retry_at = t + self._backoff
            log.warning(
                "moonraker at %s failed %d times (%s); next try in %.1f s",
                self.config.url,
                self.failures,
                self.last_error,
                self._backoff,
            )
            self._backoff = min(self._backoff * 2.0, self.config.backoff_max_s)

    @staticmethod
    def _fault_sample(t: float) -> ContextSample:
        return ContextSample(t, None, math.nan, math.nan, False, "fault", None)

    def status(self) -> dict:
        faulted = self.failures >= self.config.fail_threshold
        return {
            "state": "fault" if faulted else "ok",
            "source": "moonraker",
            "url": self.config.url,
            "failures": self.failures,
            "last_error": self.last_error,
            "retry_at": self._retry_at if faulted else None,
        }

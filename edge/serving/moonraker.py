"""Sending the speed advice to a printer's Moonraker, off the answer path, and undoing it.

Klipper's current ``SET_VELOCITY_LIMIT`` assigns the new limit without capping it at the
config's ``max_velocity``, and nothing resets it: whoever raises the limit must hold the
ceiling and restore the printer's own value.  So :class:`MoonrakerApply`:

- reads the printer's own limit (``GET /printer/objects/query?toolhead&configfile``: the live
  ``toolhead.max_velocity`` and ``configfile.settings.printer.max_velocity``) before the first
  change, and caps every advice at the least of the two;
- refuses to apply at all when ``[serve] max_advice`` is above that limit (one line, in the log
  and the status);
- reads ``toolhead.max_velocity`` back after every change it sends (a mismatch is counted);
- restores the printer's own limit, and reads it back, when ``print_stats.state`` says the print
  ended (complete, cancelled, error, or standby after printing), when the serving model stops
  advising, and when the daemon stops;
- does all of it on one worker thread fed by a bounded queue, each call with a timeout and
  bounded retries: a Moonraker that accepts a connection and never answers delays no answer
  (a full queue drops the newest request, counted).

``dry_run`` logs the request it would send instead (nothing is read or restored then).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from edge.serving.advice import tenths_down, velocity_script

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0  # each HTTP call
RETRIES = 2  # more tries after the first, for each call
QUEUE_SIZE = 8
#: While a change is in effect the worker polls ``print_stats.state`` this often.
WATCH_S = 1.0
#: ``print_stats.state`` values that end a print (``standby`` too, once printing was seen).
ENDED = ("complete", "cancelled", "error")
READBACK_TOLERANCE = 0.05  # mm/s: the script sends one decimal


class MoonrakerError(Exception):
    """A Moonraker call that failed after its retries."""


class MoonrakerApply:
    """Applies the advice through Moonraker on its own thread (see the module docstring)."""

    def __init__(
        self,
        url: str,
        dry_run: bool = True,
        api_key: str | None = None,
        max_advice: float | None = None,
        *,
        device: str = "",
        timeout_s: float = TIMEOUT_S,
        retries: int = RETRIES,
        watch_s: float = WATCH_S,
    ) -> None:
        self.url, self.dry_run, self.api_key, self.max_advice = url.rstrip("/"), dry_run, api_key, max_advice
        self.device, self.timeout_s, self.retries, self.watch_s = device, timeout_s, retries, watch_s
        self.sent = self.would_send = self.failed = self.restored = self.mismatch = self.dropped = 0
        self.last: str | None = None
        self.last_error: str | None = None
        self.refused: str | None = None  # max_advice above the printer's own limit
        self.own_limit: float | None = None  # the live limit read before our first change
        self.config_limit: float | None = None
        self.printer_max: float | None = None  # the ceiling the printer sets: the least of the two
        self.in_effect: float | None = None  # the limit we set and have not restored yet
        self._seen_printing = False
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- the answer path: never blocks ----------------------------------------------------
    def apply(self, run: str, speed: float) -> None:
        """Cap the printer at ``speed`` for print run ``run`` (queued; never raises, never waits)."""
        self._put(("advise", (run, float(speed))))

    def restore(self, why: str) -> None:
        """Put the printer's own limit back (queued), if a change of ours is in effect."""
        self._put(("restore", why))

    def _put(self, job: tuple[str, Any]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="moonraker", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            log.warning("%s: Moonraker at %s is behind; %s dropped", self.device, self.url, job[0])

    def close(self, wait_s: float | None = None) -> None:
        """Restore the printer's own limit and stop the worker (waits at most ``wait_s``)."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Empty):  # advice not sent yet is moot now: only the restore counts
            while True:
                self._queue.get_nowait()
        self.restore("the daemon stops")
        with contextlib.suppress(queue.Full):  # a worker stuck on a hung Moonraker: the join below ends it
            self._queue.put(("stop", None), timeout=1.0)
        # Time for a call in flight to time out and the restore to go; a hung Moonraker is left to the thread.
        budget = wait_s if wait_s is not None else 2 * self.timeout_s * (self.retries + 1) + 1.0
        self._thread.join(budget)

    # -- the worker -----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            try:
                kind, arg = self._queue.get(timeout=self.watch_s if self.in_effect is not None else None)
            except queue.Empty:
                self._watch()
                continue
            try:
                if kind == "stop":
                    return
                if kind == "advise":
                    self._advise(*arg)
                elif kind == "restore":
                    self._restore(arg)
            except Exception:  # a bug here must not end the worker
                log.exception("%s: applying advice failed", self.device)

    def _advise(self, run: str, speed: float) -> None:
        script = velocity_script(speed)
        if self.dry_run:
            self.would_send += 1
            self.last = script
            log.info(
                "%s: dry run: would send POST %s for print %s", self.device, self._script_url(script), run
            )
            return
        if self.in_effect is None:  # the printer's own limit, read before our first change
            try:
                self._read_limits()
            except MoonrakerError as exc:
                return self._fail(f"could not read the printer's max_velocity, nothing sent: {exc}")
        if (
            self.max_advice is not None
            and self.printer_max is not None
            and self.max_advice > self.printer_max
        ):
            self.refused = (
                f"serve.max_advice {self.max_advice:g} is above the printer's max_velocity {self.printer_max:g}; "
                "no advice is applied until it is lowered"
            )
            log.error("%s: %s", self.device, self.refused)
            return
        self.refused = None
        if self.printer_max is not None:
            speed = min(speed, self.printer_max)
        speed = tenths_down(speed)
        if self._set(speed):
            self.sent += 1
            self.in_effect = speed
            log.info("%s: sent %r to Moonraker for print %s", self.device, velocity_script(speed), run)

    def _restore(self, why: str) -> None:
        if self.in_effect is None or self.own_limit is None:
            return
        if self._set(self.own_limit):
            self.restored += 1
            log.info("%s: restored the printer's own max_velocity %g (%s)", self.device, self.own_limit, why)
            self.in_effect = None
            self._seen_printing = False

    def _watch(self) -> None:
        """A change is in effect: restore once the print has ended."""
        try:
            state = self._query("print_stats")["print_stats"]["state"]
        except (MoonrakerError, KeyError, TypeError) as exc:
            self.last_error = f"print_stats: {exc}"
            return
        if state in ("printing", "paused"):
            self._seen_printing = True
        elif state in ENDED or (state == "standby" and self._seen_printing):
            self._restore(f"the print ended: {state}")

    def _set(self, speed: float) -> bool:
        """Send the limit and read it back; whether Moonraker took it."""
        script = velocity_script(speed)
        self.last = script
        try:
            self._call(urllib.request.Request(self._script_url(script), method="POST"))
        except MoonrakerError as exc:
            return self._fail(f"did not take {script!r}: {exc}") or False
        try:
            got = float(self._query("toolhead")["toolhead"]["max_velocity"])
        except (MoonrakerError, KeyError, TypeError, ValueError) as exc:
            self.mismatch += 1
            log.warning("%s: could not read back %r: %s", self.device, script, exc)
            return True
        if abs(got - tenths_down(speed)) > READBACK_TOLERANCE:
            self.mismatch += 1
            log.warning("%s: sent %r but the toolhead reads max_velocity %g", self.device, script, got)
        self.last_error = None
        return True

    def _read_limits(self) -> None:
        status = self._query("toolhead", "configfile")
        live = float(status["toolhead"]["max_velocity"])
        try:
            configured: float | None = float(status["configfile"]["settings"]["printer"]["max_velocity"])
        except (KeyError, TypeError, ValueError):
            configured = None
        self.own_limit, self.config_limit = live, configured
        self.printer_max = live if configured is None else min(live, configured)

    def _fail(self, message: str) -> None:
        self.failed += 1
        self.last_error = message
        log.warning("%s: Moonraker at %s %s", self.device, self.url, message)

    # -- HTTP -------------------------------------------------------------------------------
    def _script_url(self, script: str) -> str:
        query = urllib.parse.urlencode({"script": script}, quote_via=urllib.parse.quote)
        return f"{self.url}/printer/gcode/script?{query}"

    def _query(self, *objects: str) -> dict:
        body = self._call(urllib.request.Request(f"{self.url}/printer/objects/query?{'&'.join(objects)}"))
        try:
            return json.loads(body)["result"]["status"]
        except (ValueError, KeyError, TypeError) as exc:
            raise MoonrakerError(f"not Moonraker's answer: {exc}") from exc

    def _call(self, req: urllib.request.Request) -> bytes:
        if self.api_key:
            req.add_header("X-Api-Key", self.api_key)
        error: Exception | None = None
        for _ in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.read()
            except (urllib.error.URLError, OSError, ValueError) as exc:
                error = exc
        raise MoonrakerError(str(error))

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "dry_run": self.dry_run, "sent": self.sent, "would_send": self.would_send,
                "failed": self.failed, "restored": self.restored, "readback_mismatch": self.mismatch,
                "dropped": self.dropped, "printer_max_velocity": self.printer_max, "own_limit": self.own_limit,
                "in_effect": self.in_effect, "refused": self.refused, "last": self.last,
                "last_error": self.last_error}  # fmt: skip

"""``edge-recorder``: fills the device's local dataset from the machine's real sensors.

A second long-running process beside ``edge-trainer``, so that recording is never
held up by training (and a training round never waits for a sensor).  It reads the
``[sensors]`` table of the device's TOML (:class:`edge.config.SensorsConfig`) and
appends rows to ``<state_dir>/dataset.safetensors`` -- the file the trainer trains on
-- through :func:`edge.dataset.save_dataset`, i.e. atomically (temp file, fsync,
rename, fsync folder; the previous copy kept as ``.prev``).

Printer (:class:`PrinterRecorder`)
    The accelerometer (ADXL345 / MPU-6050 on ``/dev/i2c-N`` through smbus2, or
    Klipper's stream) runs under :class:`~sensors.accel.supervisor.Supervisor`: a bus
    error, a wrong chip, a stuck or saturated axis or a FIFO overrun puts it into a
    reported fault state with retry and backoff, and the samples of that batch never
    reach a layer.  A missing bus (no ``/dev/i2c-1`` -- I2C not enabled) is such a
    fault too: logged with what to do, retried with backoff.  Moonraker is polled
    every ``poll_s`` on its own thread (a hung printer costs a timeout there, never a
    FIFO overrun here).  Both feed a :class:`~sensors.context.recorder.LayerRecorder`,
    which emits one PFL-DA §4.3 row per completed layer and drops (and counts) every
    layer a fault touched.  Each row is stored as ``x = sigma_a``, ``y = speed / 50``
    (:func:`sensors.layers.to_xy`), the form the simulated printers and the real data
    set have.
Welder (:class:`WelderRecorder`)
    Welds from the watched folder (:class:`~sensors.welding.folder.WatchedFolderSource`:
    marker or settle time, a ledger so a weld is delivered at most once, bad files set
    aside), the 624 DWT features of :data:`~sensors.features.schema.DEFAULT_SCHEMA`,
    labels from the operator/maintenance log for the configured task.  ``y`` is the
    class index into ``meta["classes"]``; the feature schema's hash is in
    ``meta["schema_hash"]`` and an existing dataset of another schema is refused.  A
    weld the log does not label yet waits in ``weld-pending.safetensors`` and is stored
    once the log (re-read when it changes) labels it.

Train/test split (deterministic, documented)
    A unit -- a print run (``split = "run"``, the default for printers: layers of one
    run are correlated, so a held-out run is an honest test), a layer (``"layer"``) or
    a weld (``"weld"``) -- goes to **test** when ``sha256(device NUL key)``, read as a
    fraction in [0, 1), is below ``test_fraction``, else to train; except that while the
    train split is empty every new unit goes to train, so the trainer always has rows
    to train on.  Keys: ``"<job>#<run>"`` for a run, ``"<job>#<run>/<layer>"`` for a
    layer, the weld id for a weld.  ``<run>`` numbers the print runs this device has
    recorded (persisted in the dataset's metadata): a new run starts when the job name
    changes or the layer number does not increase.  The same unit always lands in the
    same split, also across restarts.

Reporting: faults are logged as they happen and ``<state_dir>/recorder-status.json``
(written atomically every ``status_every_s`` and on exit) holds the sensor and
context status, row counts and the drop counts by reason.  SIGTERM/SIGINT end the
loop after the current step; the pending layers are finalized (only if the samples
cover them), stored, and the sensors put in standby.  Every write is atomic, so the
dataset is consistent whenever the process dies.

Welds are delivered at most once (the folder source's ledger records a weld before
handing it over): a crash between delivery and the dataset write loses that weld's
row, never duplicates it; its file stays in the folder.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import logging
import math
import queue
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from edge.config import ConfigError, DeviceConfig, SensorsConfig, build, load_toml
from edge.dataset import FILE as DATASET_FILE
from edge.dataset import load_dataset, save_dataset
from edge.state import StateError, atomic_write_json, load_arrays, save_arrays
from trainer_lite.data import Dataset

log = logging.getLogger(__name__)

STATUS_FILE = "recorder-status.json"
PENDING_FILE = "weld-pending.safetensors"
PRINTER_SOURCE = "record-printer"
WELDER_SOURCE = "record-welder"


class RecorderError(RuntimeError):
    """A setup problem the recorder cannot run with (exit status 2): fix the config or the state."""


# ----------------------------------------------------------------------------- split
def hash_fraction(device: str, key: str) -> float:
    """``sha256(device NUL key)``'s first 8 bytes as a fraction in [0, 1)."""
    digest = hashlib.sha256(f"{device}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_for(device: str, key: str, test_fraction: float, *, train_empty: bool = False) -> str:
    """``"train"`` or ``"test"`` for the unit ``key`` (see the module docstring)."""
    if train_empty:
        return "train"
    return "test" if hash_fraction(device, key) < test_fraction else "train"


# ----------------------------------------------------------------------------- dataset
class DatasetAppender:
    """The device's dataset held in memory and appended to atomically.

    Rows are buffered by :meth:`add` and written by :meth:`flush` in one atomic
    rewrite of the whole file (``save_dataset``); a write that fails (disk full) keeps
    the rows buffered for the next flush, so nothing is lost or half-written.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        source: str,
        x_dim: int,
        y_dtype: type,
        y_1d: bool,
        meta: dict[str, Any],
        check_meta: Callable[[dict], list[str]] | None = None,
        max_rows: int = 100_000,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.max_rows = int(max_rows)
        try:
            loaded = load_dataset(self.state_dir)
        except StateError as exc:
            raise RecorderError(f"{self.state_dir / DATASET_FILE}: {exc}") from None
        y_shape = (0,) if y_1d else (0, 1)
        if loaded is None:
            empty = Dataset(np.empty((0, x_dim)), np.empty(y_shape, dtype=y_dtype))
            self.data = {"train": empty, "test": empty}
            self.meta = dict(meta)
        else:
            train, test, old = loaded
            problems = []
            if old.get("source") != source:
                problems.append(
                    f"it holds rows from {old.get('source')!r}, not {source!r} -- real and simulated "
                    "(or printer and welder) rows must not be mixed; move it aside to start a new one"
                )
            elif train.x.shape[1:] != (x_dim,) or test.x.shape[1:] != (x_dim,):
                problems.append(f"its rows have {train.x.shape[1:]} inputs, expected ({x_dim},)")
            elif check_meta is not None:
                problems += check_meta(old)
            if problems:
                raise RecorderError(
                    f"cannot append to {self.state_dir / DATASET_FILE}: " + "; ".join(problems)
                )
            self.data = {"train": train, "test": test}
            self.meta = {**old, **meta}
        self._buf: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "test": []}
        self.y_1d = y_1d
        self.writes = 0
        self.write_errors = 0

    def rows(self, split: str) -> int:
        """Rows of ``split`` including those not yet written."""
        return len(self.data[split]) + len(self._buf[split])

    @property
    def pending(self) -> int:
        return len(self._buf["train"]) + len(self._buf["test"])

    def add(self, split: str, x: np.ndarray, y: np.ndarray | int | float) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        y = np.asarray(y).reshape(() if self.y_1d else (1,))
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise ValueError("row holds NaN or Inf")  # the callers check first; this is the last guard
        self._buf[split].append((x, y))

    def flush(self, meta_updates: dict[str, Any] | None = None) -> bool:
        """Write buffered rows (and ``meta_updates``); ``True`` when the file is up to date."""
        if not self.pending and not meta_updates:
            return True
        new = {}
        for split, d in self.data.items():
            rows = self._buf[split]
            if rows:
                x = np.concatenate([d.x, np.stack([r[0] for r in rows])])
                y = np.concatenate([d.y, np.stack([r[1] for r in rows]).astype(d.y.dtype)])
                if len(x) > self.max_rows:  # the oldest rows go first
                    x, y = x[-self.max_rows :], y[-self.max_rows :]
                new[split] = Dataset(x, y)
            else:
                new[split] = d
        meta = {**self.meta, **(meta_updates or {})}
        if not len(new["train"]) and not len(new["test"]):
            self.meta = meta  # no file without rows: the trainer would find nothing to train on
            return True
        meta["rows"] = {"train": len(new["train"]), "test": len(new["test"])}
        meta["updated_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        try:
            save_dataset(self.state_dir, new["train"], new["test"], meta)
        except OSError as exc:
            self.write_errors += 1
            log.error(
                "could not write %s (%s); %d rows kept for the next try", DATASET_FILE, exc, self.pending
            )
            return False
        self.data, self.meta = new, meta
        self._buf = {"train": [], "test": []}
        self.writes += 1
        return True


# ----------------------------------------------------------------------------- accelerometer
def open_smbus(number: int):
    """``smbus2.SMBus(number)``: ``/dev/i2c-<number>``."""
    from smbus2 import SMBus

    return SMBus(number)


class LazyBus:
    """An smbus2 bus opened on first use, so a missing ``/dev/i2c-N`` is a retried fault.

    Opening raises ``OSError`` with what to do (enable I2C, join the ``i2c`` group);
    the :class:`~sensors.accel.supervisor.Supervisor` logs it and retries with backoff.
    """

    def __init__(self, number: int, factory: Callable[[int], Any] = open_smbus) -> None:
        self.number, self.factory = number, factory
        self._bus = None

    @property
    def path(self) -> str:
        return f"/dev/i2c-{self.number}"

    def open(self) -> None:
        if self._bus is not None:
            return
        try:
            self._bus = self.factory(self.number)
        except FileNotFoundError:
            raise OSError(
                errno.ENOENT,
                f"I2C bus {self.path} not found: enable I2C (raspi-config > Interface Options > I2C, "
                "or dtparam=i2c_arm=on in config.txt, then reboot) or fix sensors.i2c_bus",
            ) from None
        except PermissionError:
            raise OSError(
                errno.EACCES, f"no permission to open {self.path}: run as a user in the 'i2c' group"
            ) from None

    def close(self) -> None:
        bus, self._bus = self._bus, None
        if bus is not None:
            with contextlib.suppress(OSError):
                bus.close()

    def __getattr__(self, name: str):
        bus = self.__dict__.get("_bus")
        if bus is None:
            raise OSError(errno.EBADF, f"I2C bus {self.path} is not open")
        return getattr(bus, name)


class I2cAccel:
    """An I2C accelerometer driver whose ``start()`` first opens the bus."""

    def __init__(self, cfg: SensorsConfig, clock: Callable[[], float], bus_factory=open_smbus) -> None:
        from sensors.accel.adxl345 import Adxl345
        from sensors.accel.mpu6050 import Mpu6050

        self.bus = LazyBus(cfg.i2c_bus, bus_factory)
        driver_cls = Adxl345 if cfg.accel == "adxl345" else Mpu6050
        self.driver = driver_cls(self.bus, cfg.i2c_address, cfg.rate_hz, cfg.range_g, clock=clock)
        self.rate_hz = self.driver.rate_hz

    def start(self) -> None:
        self.bus.open()
        self.driver.start()

    def read(self):
        return self.driver.read()

    def close(self) -> int:
        return int(self.driver.close() or 0)

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.driver.close()
        self.bus.close()

    def status(self) -> dict:
        return {**self.driver.status(), "bus": self.bus.path, "address": f"0x{self.driver.address:02X}"}


def build_accel(cfg: SensorsConfig, clock: Callable[[], float], bus_factory=open_smbus):
    """The configured accelerometer source (not yet supervised, not started)."""
    if cfg.accel == "klipper":
        from sensors.accel.klipper import KlipperAccelSource

        return KlipperAccelSource(cfg.klipper_socket, cfg.klipper_chip, rate_hz=cfg.rate_hz, clock=clock)
    return I2cAccel(cfg, clock, bus_factory)


def build_context(cfg: SensorsConfig, clock: Callable[[], float]):
    """The configured printer-context source.

    Only Moonraker: a G-code file's timeline (:class:`~sensors.context.gcode.GcodeContext`)
    needs the moment its print started, which a long-running recorder cannot know.
    """
    from sensors.context.moonraker import MoonrakerConfig, MoonrakerContext

    mc = MoonrakerConfig(
        url=cfg.moonraker_url, timeout_s=cfg.moonraker_timeout_s, api_key=cfg.moonraker_api_key
    )
    return MoonrakerContext(mc, clock)


def _fault_sample(t: float):
    from sensors.context.base import ContextSample

    return ContextSample(t, None, math.nan, math.nan, False, "fault", None)


class ContextPoller:
    """Polls a printer context every ``poll_s`` on its own thread; :meth:`drain` hands samples over."""

    def __init__(self, context, poll_s: float, clock: Callable[[], float]) -> None:
        self.context, self.poll_s, self.clock = context, float(poll_s), clock
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="context-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._q.put(poll_context(self.context, self.clock))
            self._stop.wait(max(0.0, self.poll_s - (time.monotonic() - started)))

    def drain(self) -> list:
        out = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._q.get_nowait())
        return out

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def poll_context(context, clock: Callable[[], float]):
    """``context.poll()``, or a fault sample if it raises (sources should not, but never crash)."""
    try:
        return context.poll()
    except Exception as exc:  # the loop must go on; the layer is dropped
        log.error("printer context poll failed: %r", exc)
        return _fault_sample(float(clock()))


# ----------------------------------------------------------------------------- loop
class _Loop:
    """The shared loop: pacing on a real or virtual clock, stop, status file, error containment."""

    kind = ""
    interval_s = 0.1

    def __init__(self, device: str, state_dir: Path, cfg: SensorsConfig, clock: Callable[[], float]) -> None:
        self.device, self.state_dir, self.cfg, self.clock = device, Path(state_dir), cfg, clock
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.virtual = hasattr(clock, "advance")
        self.steps = 0
        self.appended = 0
        self.loop_errors = 0
        self.last_row_at: str | None = None
        self._next_status = -math.inf
        self._stop = threading.Event()

    # subclasses
    def start(self) -> None: ...

    def step(self) -> int:
        raise NotImplementedError

    def finish(self) -> None: ...

    def status(self) -> dict:
        return {}

    def stop(self) -> None:
        self._stop.set()

    def _pause(self, dt: float) -> None:
        if dt <= 0:
            return
        if self.virtual:
            self.clock.advance(dt)  # type: ignore[attr-defined]
        else:
            self._stop.wait(dt)

    def run(self, stop: threading.Event | None = None, *, until: Callable[[], bool] | None = None) -> None:
        """Record until ``stop`` is set (or ``until()`` is true); then finish cleanly."""
        if stop is not None:
            self._stop = stop
        self.start()
        failures = 0
        try:
            while not self._stop.is_set() and not (until is not None and until()):
                began = self.clock()
                try:
                    self.step()
                    failures = 0
                except Exception:  # a bug or unforeseen fault must not stop recording
                    self.loop_errors += 1
                    failures += 1
                    log.exception("recorder step failed (%d in a row); going on", failures)
                    self._pause(min(30.0, 0.5 * 2 ** min(failures, 6)))
                self.steps += 1
                self._maybe_status()
                self._pause(self.interval_s - (self.clock() - began))
        finally:
            try:
                self.finish()
            finally:
                self.write_status(final=True)
        log.info("%s recorder stopped: %d rows appended this run", self.kind, self.appended)

    def _maybe_status(self) -> None:
        now = self.clock()
        if now >= self._next_status:
            self._next_status = now + self.cfg.status_every_s
            self.write_status()

    def write_status(self, *, final: bool = False) -> None:
        body = {
            "device": self.device,
            "kind": self.kind,
            "running": not final,
            "updated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "appended": self.appended,
            "last_row_at": self.last_row_at,
            "loop_errors": self.loop_errors,
            **self.status(),
        }
        try:
            atomic_write_json(self.state_dir / STATUS_FILE, body)
        except (OSError, TypeError, ValueError) as exc:
            log.warning("could not write %s: %s", STATUS_FILE, exc)

    def _stored(self, n: int) -> None:
        if n:
            self.appended += n
            self.last_row_at = datetime.now(UTC).isoformat(timespec="seconds")


class PrinterRecorder(_Loop):
    """Accelerometer + printer context → one dataset row per completed layer."""

    kind = "printer"

    def __init__(
        self,
        device: str,
        state_dir: Path,
        cfg: SensorsConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        bus_factory: Callable[[int], Any] = open_smbus,
        accel=None,
        context=None,
        context_thread: bool | None = None,
    ) -> None:
        from sensors.accel.adxl345 import FIFO_DEPTH
        from sensors.accel.supervisor import Supervisor
        from sensors.context.recorder import LayerRecorder

        super().__init__(device, state_dir, cfg, clock)
        self.source = accel if accel is not None else build_accel(cfg, clock, bus_factory)
        self.accel = Supervisor(self.source, clock=clock)
        self.context = context if context is not None else build_context(cfg, clock)
        self.layers = LayerRecorder(self.accel.rate_hz)
        # Drain the FIFO at least twice per fill (32 entries; Klipper batches every ~0.1 s).
        fill_s = FIFO_DEPTH / self.accel.rate_hz if cfg.accel != "klipper" else 0.2
        self.interval_s = cfg.read_interval_s or min(cfg.poll_s, fill_s / 2)
        threaded = (not self.virtual) if context_thread is None else context_thread
        self.poller = ContextPoller(self.context, cfg.poll_s, clock) if threaded else None
        self._next_poll = -math.inf
        self._horizon = -math.inf
        self._held: deque = deque()
        self.max_hold_s = max(2.0, 4 * cfg.poll_s + 2 * cfg.moonraker_timeout_s)
        self.invalid_rows = 0
        self.data = DatasetAppender(
            self.state_dir,
            source=PRINTER_SOURCE,
            x_dim=1,
            y_dtype=np.float64,
            y_1d=False,
            meta={
                "source": PRINTER_SOURCE,
                "columns": {"x": ["sigma_a"], "y": ["speed/50"]},
                "split": cfg.split_rule,
                "test_fraction": cfg.test_fraction,
                "accel": cfg.accel,
                "accel_hz": self.accel.rate_hz,
                "context": cfg.context,
            },
            max_rows=cfg.row_limit,
        )
        self._dropped_before = Counter(self.data.meta.get("dropped_layers", {}))
        self.run_state: dict | None = self.data.meta.get("run")
        self.runs = int(self.data.meta.get("runs", 0))

    def start(self) -> None:
        log.info(
            "recording printer %s: %s at %.1f Hz, context %s every %.2f s, into %s",
            self.device,
            self.cfg.accel,
            self.accel.rate_hz,
            getattr(getattr(self.context, "config", None), "url", self.cfg.context),
            self.cfg.poll_s,
            self.state_dir / DATASET_FILE,
        )
        self.accel.start()
        if self.poller is not None:
            self.poller.start()

    def _context_samples(self) -> list:
        if self.poller is not None:
            return self.poller.drain()
        now = self.clock()
        if now < self._next_poll:
            return []
        self._next_poll = now + self.cfg.poll_s
        return [poll_context(self.context, self.clock)]

    def step(self) -> int:
        rows = []
        for sample in self._context_samples():
            rows += self.layers.add_context(sample)
            self._horizon = max(self._horizon, sample.t)
        t_read = self.clock()
        batch = self.accel.read()
        self._held.append((t_read, batch, self.accel.state == "ok"))
        rows += self._feed_accel()
        return self._store(rows)

    def _feed_accel(self, *, everything: bool = False) -> list:
        """Hand held accelerometer batches to the layer recorder, in time order with the context.

        A batch is fed once a context sample at least as new as its read has been fed: the
        recorder forgets samples no open layer needs, so the samples at the start of a print
        must not pass before the (threaded, later-arriving) context sample that opens its
        first layer.  A context that stays silent holds batches back at most ``max_hold_s``.
        """
        rows = []
        stale = self.clock() - self.max_hold_s
        while self._held and (everything or self._held[0][0] <= self._horizon or self._held[0][0] < stale):
            _, batch, ok = self._held.popleft()
            rows += self.layers.add_accel(batch, ok=ok)
        return rows

    def _unit(self, row) -> tuple[str, str]:
        """The split key of ``row`` and its run's split, starting a new run when this row does."""
        r = self.run_state
        if r is None or r["job"] != row.job or row.layer <= r["last_layer"]:
            self.runs += 1
            r = self.run_state = {"job": row.job, "n": self.runs, "last_layer": row.layer, "split": None}
        r["last_layer"] = row.layer
        run_key = f"{row.job}#{r['n']}"
        if self.cfg.split_rule == "layer":
            key = f"{run_key}/{row.layer}"
            return key, split_for(
                self.device, key, self.cfg.test_fraction, train_empty=self.data.rows("train") == 0
            )
        if r["split"] is None:
            r["split"] = split_for(
                self.device, run_key, self.cfg.test_fraction, train_empty=self.data.rows("train") == 0
            )
        return run_key, r["split"]

    def _store(self, rows: list) -> int:
        from sensors.layers import to_xy

        added = 0
        for row in rows:
            values = (row.speed, row.sigma_ax, row.sigma_ay)
            if not all(math.isfinite(v) and v >= 0 for v in values) or row.layer < 0:
                self.invalid_rows += 1
                log.warning("dropped an invalid layer row %s", row)
                continue
            x, y = to_xy(np.array([values]))
            key, split = self._unit(row)
            self.data.add(split, x[0], y[0])
            added += 1
            log.debug("layer %s -> %s (speed %.2f, sigma_a %.4f)", key, split, row.speed, row.sigma_a)
        meta = {"run": self.run_state, "runs": self.runs, "dropped_layers": self._dropped()}
        if (added or self.data.pending) and self.data.flush(meta):
            log.info(
                "stored %d layer row(s): %d train / %d test",
                added,
                len(self.data.data["train"]),
                len(self.data.data["test"]),
            )
        self._stored(added)
        return added

    def _dropped(self) -> dict:
        """Layers dropped by reason, over every run of the recorder on this dataset."""
        return dict(self._dropped_before + Counter(self.layers.dropped))

    def finish(self) -> None:
        try:
            if self.poller is not None:
                self.poller.stop(timeout=self.cfg.moonraker_timeout_s + 1.0)
                for sample in self.poller.drain():
                    self._store(self.layers.add_context(sample))
            with contextlib.suppress(Exception):
                batch = self.accel.read()
                self._held.append((self.clock(), batch, self.accel.state == "ok"))
            self._store(self._feed_accel(everything=True))
            # Layers that ended are kept if the samples cover them (flush checks gaps);
            # the open layer is incomplete and is not stored.
            self._store(self.layers.flush())
            self.data.flush({"dropped_layers": self._dropped()} if self.layers.dropped else None)
        finally:
            with contextlib.suppress(Exception):
                self.accel.close()
            shutdown = getattr(self.source, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def status(self) -> dict:
        accel = {}
        with contextlib.suppress(Exception):
            accel = self.accel.status()
        context = {}
        with contextlib.suppress(Exception):
            context = self.context.status()
        return {
            "state": "fault" if "fault" in (accel.get("state"), context.get("state")) else "ok",
            "accel": accel,
            "context": context,
            "rows": {"train": self.data.rows("train"), "test": self.data.rows("test")},
            "layers_emitted": len(self.layers.rows),
            "dropped_layers": dict(self.layers.dropped),
            "invalid_rows": self.invalid_rows,
            "write_errors": self.data.write_errors,
        }


class WelderRecorder(_Loop):
    """Watched folder + label log → one labelled DWT feature row per weld."""

    kind = "welder"
    max_welds_per_step = 16

    def __init__(
        self,
        device: str,
        state_dir: Path,
        cfg: SensorsConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        schema=None,
    ) -> None:
        from sensors.features.schema import DEFAULT_SCHEMA
        from sensors.welding.folder import FolderSourceConfig, WatchedFolderSource
        from sensors.welding.labels import SURFACES, TOOL_CLASSES_M, TOOL_CLASSES_S

        super().__init__(device, state_dir, cfg, clock)
        self.schema = schema or DEFAULT_SCHEMA
        self.schema_hash = self.schema.schema_hash()
        self.classes = list(
            {"tool_m": TOOL_CLASSES_M, "tool_s": TOOL_CLASSES_S, "surface": dict.fromkeys(SURFACES)}[
                cfg.target
            ]
        )
        self.interval_s = cfg.poll_s
        self.source = WatchedFolderSource(
            FolderSourceConfig(
                Path(cfg.weld_folder), state_dir=self.state_dir / "weld-ledger", settle_s=cfg.settle_s
            ),
            clock=clock,
        )
        self._source_ready = False
        self._retry_at = -math.inf
        self._backoff = 1.0
        self.label_path = Path(cfg.label_log)
        self.labels = None
        self._label_sig: tuple | None = None
        self._labels_changed = False
        self.label_errors = 0
        self.skipped = 0

        def check(meta: dict) -> list[str]:
            out = []
            if meta.get("schema_hash") != self.schema_hash:
                out.append(
                    f"its feature schema {str(meta.get('schema_hash'))[:12]}... is not this recorder's "
                    f"{self.schema_hash[:12]}..."
                )
            if meta.get("target") != cfg.target or meta.get("classes") != self.classes:
                out.append(
                    f"it is labelled for {meta.get('target')!r} {meta.get('classes')}, not {cfg.target!r}"
                )
            return out

        self.data = DatasetAppender(
            self.state_dir,
            source=WELDER_SOURCE,
            x_dim=self.schema.n_features,
            y_dtype=np.int64,
            y_1d=True,
            meta={
                "source": WELDER_SOURCE,
                "schema_hash": self.schema_hash,
                "target": cfg.target,
                "classes": self.classes,
                "split": "weld",
                "test_fraction": cfg.test_fraction,
            },
            check_meta=check,
            max_rows=cfg.row_limit,
        )
        self._load_pending()

    # -- pending (welds the log does not label yet) -------------------------------------
    def _load_pending(self) -> None:
        self.pending: list[dict] = []
        try:
            loaded = load_arrays(self.state_dir / PENDING_FILE)
        except StateError as exc:
            log.error("pending welds unreadable (%s); starting without them", exc)
            loaded = None
        if loaded is None:
            return
        arrays, meta = loaded
        done = set(self.data.meta.get("last_weld_ids", []))
        for i, info in enumerate(meta.get("welds", [])):
            if info["weld_id"] not in done:  # a crash after the dataset write, before this file's
                self.pending.append({**info, "features": arrays["x"][i]})
        if len(self.pending) != len(meta.get("welds", [])):
            self._save_pending()

    def _save_pending(self) -> None:
        keep = self.pending[-self.cfg.max_pending_welds :] if self.cfg.max_pending_welds else []
        if len(keep) < len(self.pending):
            log.warning("dropping %d unlabelled welds (max_pending_welds)", len(self.pending) - len(keep))
        self.pending = keep
        x = (
            np.stack([p["features"] for p in keep])
            if keep
            else np.empty((0, self.data.data["train"].x.shape[1]))
        )
        meta = {"welds": [{k: v for k, v in p.items() if k != "features"} for p in keep]}
        try:
            save_arrays(self.state_dir / PENDING_FILE, {"x": x}, meta)
        except OSError as exc:
            log.error("could not write %s: %s", PENDING_FILE, exc)

    # -- labels ------------------------------------------------------------------------
    def _reload_labels(self) -> bool:
        """Re-read the label log when it changed; ``True`` if a new version was loaded."""
        from sensors.welding.labels import LabelLog, LabelLogError

        try:
            st = self.label_path.stat()
        except OSError:
            if self._label_sig != ("missing",):
                log.warning("label log %s not found; welds wait unlabelled until it exists", self.label_path)
                self._label_sig = ("missing",)
            return False
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig == self._label_sig:
            return False
        self._label_sig = sig
        try:
            self.labels = LabelLog.load(self.label_path)
        except (LabelLogError, OSError) as exc:
            self.label_errors += 1
            log.error("label log %s unusable, keeping the previous version: %s", self.label_path, exc)
            return False
        self._labels_changed = True  # pending welds get another look at the next step
        return True

    def _class_of(self, label) -> int | None:
        """The class index of ``label`` for the configured task, ``None`` if it does not say."""
        name = {"tool_m": label.tool_class_m, "tool_s": label.tool_class_s, "surface": label.surface}[
            self.cfg.target
        ]
        return self.classes.index(name) if name in self.classes else None

    # -- loop --------------------------------------------------------------------------
    def start(self) -> None:
        log.info(
            "recording welder %s: welds from %s, labels %s (%s), into %s",
            self.device,
            self.cfg.weld_folder,
            self.label_path,
            self.cfg.target,
            self.state_dir / DATASET_FILE,
        )
        self._reload_labels()

    def _ensure_source(self) -> bool:
        if self._source_ready:
            return True
        if self.clock() < self._retry_at:
            return False
        try:
            self.source.setup()
        except OSError as exc:
            log.warning("weld folder not usable (%s); retry in %.0f s", exc, self._backoff)
            self._retry_at = self.clock() + self._backoff
            self._backoff = min(self._backoff * 2, 60.0)
            return False
        self._source_ready, self._backoff = True, 1.0
        return True

    def step(self) -> int:
        from sensors.welding.pipeline import labelled_rows

        self._reload_labels()
        relabel, self._labels_changed = self._labels_changed and bool(self.pending), False
        stored: list[str] = []
        pending_changed = False
        if relabel:
            still = []
            for p in self.pending:
                label = self.labels.label(p["weld_id"], datetime.fromisoformat(p["started_at"]))
                k = self._class_of(label)
                if k is None:
                    still.append(p)
                else:
                    self._add(p["weld_id"], p["features"], k)
                    stored.append(p["weld_id"])
            pending_changed = len(still) != len(self.pending)
            self.pending = still
        if self._ensure_source():
            for _ in range(self.max_welds_per_step):
                try:
                    rec = self.source.read()
                except OSError as exc:  # the folder went away (network share): set up again later
                    log.warning("weld folder read failed (%s); will set it up again", exc)
                    self.source.close()
                    self._source_ready = False
                    break
                if rec is None:
                    break
                rows = list(labelled_rows([rec], self.labels, self.schema))
                if not rows:
                    self.skipped += 1  # logged by labelled_rows: does not fit the schema
                    continue
                row = rows[0]
                if row.schema_hash != self.schema_hash or not np.isfinite(row.features).all():
                    self.skipped += 1
                    log.warning("weld %s: features unusable, not stored", row.weld_id)
                    continue
                k = self._class_of(row.label)
                if k is None:
                    log.info("weld %s not labelled for %s yet; kept pending", row.weld_id, self.cfg.target)
                    self.pending.append(
                        {
                            "weld_id": row.weld_id,
                            "started_at": row.started_at.isoformat(),
                            "source": str(row.source),
                            "features": row.features,
                        }
                    )
                    pending_changed = True
                else:
                    self._add(row.weld_id, row.features, k)
                    stored.append(row.weld_id)
        if stored:
            if not self.data.flush({"last_weld_ids": stored}):
                return 0
            log.info(
                "stored %d weld row(s): %d train / %d test",
                len(stored),
                len(self.data.data["train"]),
                len(self.data.data["test"]),
            )
        elif self.data.pending:
            self.data.flush()
        if pending_changed:
            self._save_pending()
        self._stored(len(stored))
        return len(stored)

    def _add(self, weld_id: str, features: np.ndarray, k: int) -> None:
        split = split_for(
            self.device, weld_id, self.cfg.test_fraction, train_empty=self.data.rows("train") == 0
        )
        self.data.add(split, features, k)

    def finish(self) -> None:
        try:
            self.data.flush()
        finally:
            self.source.close()

    def status(self) -> dict:
        stats = self.source.stats
        return {
            "state": "ok" if self._source_ready and self.labels is not None else "fault",
            "folder": {
                "path": str(self.cfg.weld_folder),
                "ready": self._source_ready,
                "delivered": stats.delivered,
                "rejected": stats.rejected,
                "duplicates": stats.duplicates,
            },
            "labels": {
                "path": str(self.label_path),
                "loaded": self.labels is not None,
                "errors": self.label_errors,
            },
            "rows": {"train": self.data.rows("train"), "test": self.data.rows("test")},
            "pending_welds": len(self.pending),
            "skipped_welds": self.skipped,
            "write_errors": self.data.write_errors,
            "schema_hash": self.schema_hash,
        }


def make_recorder(config: DeviceConfig, **kwargs) -> PrinterRecorder | WelderRecorder:
    """The recorder ``config.sensors`` describes.

    Raises
    ------
    RecorderError
        No ``[sensors]`` table, a trainer configured to simulate (it would fill the same
        file), or a dataset that cannot be appended to.
    """
    cfg = config.sensors
    if cfg is None:
        raise RecorderError("the config has no [sensors] table: say what to record (see README)")
    if config.data.source != "state":
        raise RecorderError(
            f"[data] source = {config.data.source!r}: the trainer simulates its dataset; "
            "edge-recorder fills it only with [data] source = 'state' (the default)"
        )
    cls = PrinterRecorder if cfg.kind == "printer" else WelderRecorder
    return cls(config.device, Path(config.state_dir), cfg, **kwargs)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="edge-recorder",
        description="ioft device recorder: appends rows from this machine's sensors to its local dataset.",
    )
    p.add_argument("--device", required=True, help="this device's id, e.g. printer3")
    p.add_argument(
        "--config", type=Path, required=True, help="the device's TOML config, with a [sensors] table"
    )
    p.add_argument(
        "--state-dir", help="where the dataset lives (default: the config's, else /var/lib/ioft/<device>)"
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s {args.device} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        raw = load_toml(args.config)
        raw["device"] = args.device
        if args.state_dir:
            raw["state_dir"] = args.state_dir
        elif "state_dir" not in raw:
            raw["state_dir"] = f"/var/lib/ioft/{args.device}"
        config = build(DeviceConfig, raw, str(args.config))
        recorder = make_recorder(config)
    except (ConfigError, RecorderError) as exc:
        print(f"edge-recorder: {exc}", file=sys.stderr)
        return 2
    run_until_signalled(recorder)
    return 0


def run_until_signalled(recorder: PrinterRecorder | WelderRecorder) -> None:
    """Run ``recorder`` in this (main) thread until SIGTERM or SIGINT, then finish cleanly."""
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("signal %d: stopping after this step", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    recorder.run(stop)


if __name__ == "__main__":
    sys.exit(main())

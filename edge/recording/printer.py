"""The printer recorder: accelerometer (I2C or Klipper) under the Supervisor, Moonraker polled
on its own thread, the LayerRecorder, one PFL-DA §4.3 row per completed layer."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge.config import SensorsConfig
from edge.dataset import DIR as DATASET_DIR
from edge.recording.base import DatasetAppender, RecorderLoop, split_for
from edge.rows import Row

log = logging.getLogger(__name__)

PRINTER_SOURCE = "record-printer"


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
class PrinterRecorder(RecorderLoop):
    """Accelerometer + printer context → one dataset row per completed layer.

    ``source`` tags the dataset's rows: a simulated printer inside ``edge-trainer --simulate``
    appends to the trainer's simulated history under its tag, never to a real one.
    """

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
        source: str = PRINTER_SOURCE,
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
        self.data = self._appender(cfg, source)
        self._dropped_before = Counter(self.data.meta.get("dropped_layers", {}))
        self.run_state: dict | None = self.data.meta.get("run")
        self.runs = int(self.data.meta.get("runs", 0))

    def _appender(self, cfg: SensorsConfig, source: str) -> DatasetAppender:
        """The dataset the layers' rows go to: one ``sigma_a`` per row, the speed as its target."""
        meta = {
            "source": source,
            "columns": {"x": ["sigma_a"], "y": ["speed/50"]},
            "split": cfg.split_rule,
            "test_fraction": cfg.test_fraction,
            "accel": cfg.accel,
            "accel_hz": self.accel.rate_hz,
            "context": cfg.context,
        }
        return DatasetAppender(
            self.state_dir,
            source=source,
            x_dim=1,
            y_dtype=np.float64,
            y_1d=False,
            meta=meta,
            max_rows=cfg.row_limit,
        )

    def start(self) -> None:
        log.info(
            "recording printer %s: %s at %.1f Hz, context %s every %.2f s, into %s",
            self.device,
            self.cfg.accel,
            self.accel.rate_hz,
            getattr(getattr(self.context, "config", None), "url", self.cfg.context),
            self.cfg.poll_s,
            self.state_dir / DATASET_DIR,
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
            run = f"{row.job}#{self.run_state['n']}"  # type: ignore[index] -- _unit set it
            self.feed.put(
                Row("layer", f"{run}/{row.layer}", time.time(), tuple(x[0]), commanded=float(row.speed))
            )
            added += 1
            log.debug("layer %s -> %s (speed %.2f, sigma_a %.4f)", key, split, row.speed, row.sigma_a)
        meta = {"run": self.run_state, "runs": self.runs, "dropped_layers": self._dropped()}
        if (added or self.data.pending) and self.data.flush(meta):
            log.info(
                "stored %d layer row(s): %d train / %d test",
                added,
                self.data.stored("train"),
                self.data.stored("test"),
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

"""Live weld capture from an ALSA device (microphone, AE preamp, line input) via ``arecord``.

Why ``arecord`` in a subprocess rather than a Python ALSA binding: it ships with
``alsa-utils`` on every Raspberry Pi OS image, needs no compiled extension on the Pi,
does its own period/ring-buffer handling in C (``-B`` sets a ring buffer of seconds,
which absorbs the daemon's pauses for feature extraction or MQTT), and any ALSA PCM
(``hw:``, ``plughw:``, a ``dsnoop`` share, a ``file`` plugin in tests) is just a
``-D`` name.  We read raw interleaved PCM from its stdout, cut it into welds with
:class:`~sensors.welding.segment.EnergySegmenter` and hand out
:class:`~sensors.welding.recording.WeldRecording` objects.

Sample rate: FTL-TP's sensors are sampled above 200 kHz.  Use an interface that
captures at >= 200 kHz (e.g. a 384 kHz USB interface through ``plughw:``, which
resamples to the requested rate); the default feature schema expects exactly 200 kHz.

Timestamps: sample ``k`` is stamped ``t0 + k / rate`` where ``t0`` is the earliest
``wall time - samples received / rate`` seen up to the first weld (data cannot arrive
before it was sampled, so buffering delays do not skew it), then kept for the whole
capture so stamps stay monotonic; the sound card's clock may still drift from the
system clock by tens of ppm over long captures.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta

import numpy as np

from sensors.welding.recording import MIN_SAMPLE_RATE, SourceConfigError, WeldRecording
from sensors.welding.segment import EnergySegmenter, Segment, SegmenterConfig

log = logging.getLogger(__name__)

#: ALSA sample format -> (NumPy dtype, full-scale divisor).
FORMATS: dict[str, tuple[str, float]] = {
    "S16_LE": ("<i2", float(1 << 15)),
    "S32_LE": ("<i4", float(1 << 31)),
    "FLOAT_LE": ("<f4", 1.0),
}


class AlsaCaptureError(RuntimeError):
    """``arecord`` is missing or failed; the message carries its stderr."""


@dataclass(frozen=True)
class AlsaConfig:
    """Settings of an :class:`AlsaWeldSource`.

    Parameters
    ----------
    device
        ALSA PCM name passed to ``arecord -D`` (``hw:1,0``, ``plughw:CARD=U192k``...).
    channels
        Names of the captured channels, in the device's channel order.
    sample_rate
        Capture rate in Hz.
    sample_format
        One of :data:`FORMATS`.
    trigger_channel
        Channel whose energy segments welds (default: the first).
    drop_trigger
        Leave the trigger channel out of the recordings (a dedicated trigger line).
    on_rms, off_rms, frame_s, hangover_s, pre_s, post_s, min_weld_s, max_weld_s
        Segmentation (RMS in full-scale units); see :mod:`sensors.welding.segment`.
    buffer_time_us
        ``arecord -B``: ALSA ring buffer, microseconds.
    read_frames
        Frames per read from ``arecord``'s stdout.
    sample_limit
        ``arecord -s``: stop after this many frames (one-shot captures, tests).
    arecord
        Path or name of the ``arecord`` binary.
    env
        Extra environment for ``arecord`` (e.g. ``ALSA_CONFIG_PATH``).
    weld_id_prefix
        Weld ids are ``<prefix>-<UTC start time>``.
    min_sample_rate
        Passed to :class:`WeldRecording`.
    """

    device: str = "default"
    channels: tuple[str, ...] = ("mic",)
    sample_rate: int = 200_000
    sample_format: str = "S16_LE"
    trigger_channel: str | None = None
    drop_trigger: bool = False
    # The segmenter's settings take its own defaults: the numbers live in SegmenterConfig alone.
    on_rms: float = SegmenterConfig.on_rms
    off_rms: float = SegmenterConfig.off_rms
    frame_s: float = SegmenterConfig.frame_s
    hangover_s: float = SegmenterConfig.hangover_s
    pre_s: float = SegmenterConfig.pre_s
    post_s: float = SegmenterConfig.post_s
    min_weld_s: float = SegmenterConfig.min_weld_s
    max_weld_s: float = SegmenterConfig.max_weld_s
    buffer_time_us: int = 2_000_000
    read_frames: int = 4096
    sample_limit: int | None = None
    arecord: str = "arecord"
    env: Mapping[str, str] = field(default_factory=dict)
    weld_id_prefix: str = "alsa"
    min_sample_rate: float = MIN_SAMPLE_RATE

    def __post_init__(self) -> None:
        object.__setattr__(self, "channels", tuple(self.channels))
        errors = []
        if not self.channels or len(set(self.channels)) != len(self.channels):
            errors.append(f"channels must be non-empty and unique (got {self.channels!r})")
        if self.sample_format not in FORMATS:
            errors.append(f"sample_format must be one of {tuple(FORMATS)} (got {self.sample_format!r})")
        if self.trigger_channel is not None and self.trigger_channel not in self.channels:
            errors.append(f"trigger_channel {self.trigger_channel!r} not in channels {self.channels}")
        if self.drop_trigger and len(self.channels) < 2:
            errors.append("drop_trigger needs at least one other channel")
        if not isinstance(self.sample_rate, int) or self.sample_rate < 1:
            errors.append(f"sample_rate must be a positive int (got {self.sample_rate!r})")
        if self.sample_rate < self.min_sample_rate:
            errors.append(f"sample_rate {self.sample_rate} is below min_sample_rate {self.min_sample_rate:g}")
        if self.read_frames < 1 or self.buffer_time_us < 1000:
            errors.append("read_frames must be >= 1 and buffer_time_us >= 1000")
        if self.sample_limit is not None and self.sample_limit < 1:
            errors.append(f"sample_limit must be >= 1 (got {self.sample_limit})")
        errors += self.segmenter_config().errors()
        if errors:
            raise SourceConfigError("invalid AlsaConfig: " + "; ".join(errors))

    def segmenter_config(self) -> SegmenterConfig:
        """The segmentation part of this config."""
        timing = {f.name: getattr(self, f.name) for f in fields(SegmenterConfig) if f.name != "sample_rate"}
        return SegmenterConfig(sample_rate=float(self.sample_rate), **timing)

    def command(self) -> list[str]:
        """The ``arecord`` command line."""
        cmd = [
            self.arecord,
            "-q",
            "-D",
            self.device,
            "-f",
            self.sample_format,
            "-r",
            str(self.sample_rate),
            "-c",
            str(len(self.channels)),
            "-t",
            "raw",
            "-B",
            str(self.buffer_time_us),
        ]
        if self.sample_limit is not None:
            cmd += ["-s", str(self.sample_limit)]
        return [*cmd, "-"]


class AlsaWeldSource:
    """Segmented welds from a live ALSA capture.

    Follows the sensor driver contract: ``setup()`` starts ``arecord``, ``read()``
    blocks until the next weld (``None`` once the capture ends), ``close()`` stops it.

    Parameters
    ----------
    config
        See :class:`AlsaConfig`.
    clock
        Wall clock in seconds (tests may pass a fake one).
    """

    def __init__(self, config: AlsaConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: deque[str] = deque(maxlen=50)
        self._stderr_thread: threading.Thread | None = None
        self._segmenter: EnergySegmenter | None = None
        self._ready: deque[WeldRecording] = deque()
        self._leftover = b""
        self._received = 0
        self._t0: float | None = None
        self._t0_frozen = False
        self._ended = False
        self.overruns = 0

    def setup(self) -> None:
        """Start ``arecord``.

        Raises
        ------
        AlsaCaptureError
            If ``arecord`` is not installed.
        """
        cfg = self.config
        binary = shutil.which(cfg.arecord)
        if binary is None:
            raise AlsaCaptureError(
                f"{cfg.arecord!r} not found; install it with 'sudo apt-get install alsa-utils'"
            )
        trigger = cfg.channels.index(cfg.trigger_channel) if cfg.trigger_channel else 0
        self._segmenter = EnergySegmenter(cfg.segmenter_config(), trigger=trigger)
        env = {**os.environ, **cfg.env}
        log.info("starting %s", " ".join(cfg.command()))
        self._proc = subprocess.Popen(
            [binary, *cfg.command()[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        self._stderr_thread = threading.Thread(target=self._drain_stderr, name="arecord-stderr", daemon=True)
        self._stderr_thread.start()
        self._ended = False

    def _drain_stderr(self) -> None:
        proc = self._proc
        if proc is None or proc.stderr is None:
            return
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            self._stderr.append(line)
            if "overrun" in line:
                self.overruns += 1
                log.warning("arecord: %s (audio lost; raise buffer_time_us or read faster)", line)
            else:
                log.info("arecord: %s", line)

    def __enter__(self) -> AlsaWeldSource:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[WeldRecording]:
        while (rec := self.read()) is not None:
            yield rec

    def read(self) -> WeldRecording | None:
        """Block until the next weld; ``None`` when the capture has ended.

        Raises
        ------
        AlsaCaptureError
            If ``arecord`` exits with an error (bad device, unsupported rate...).
        """
        if self._proc is None or self._proc.stdout is None or self._segmenter is None:
            raise RuntimeError("AlsaWeldSource.setup() has not been called (or close() was)")
        cfg = self.config
        frame_bytes = np.dtype(FORMATS[cfg.sample_format][0]).itemsize * len(cfg.channels)
        while not self._ready and not self._ended:
            chunk = self._proc.stdout.read1(cfg.read_frames * frame_bytes)
            if not chunk:
                self._finish()
                break
            data = self._leftover + chunk
            usable = len(data) - len(data) % frame_bytes
            self._leftover = data[usable:]
            if usable:
                self._consume(data[:usable])
        return self._ready.popleft() if self._ready else None

    def _consume(self, raw: bytes) -> None:
        cfg = self.config
        dtype, scale = FORMATS[cfg.sample_format]
        block = np.frombuffer(raw, dtype=dtype).reshape(-1, len(cfg.channels)).T.astype(np.float64)
        if scale != 1.0:
            block /= scale
        self._received += block.shape[1]
        if not self._t0_frozen:
            now = self._clock() - self._received / cfg.sample_rate
            self._t0 = now if self._t0 is None else min(self._t0, now)
        for seg in self._segmenter.feed(block):  # type: ignore[union-attr]
            self._ready.append(self._recording(seg))

    def _finish(self) -> None:
        self._ended = True
        for seg in self._segmenter.flush():  # type: ignore[union-attr]
            self._ready.append(self._recording(seg))
        proc = self._proc
        if proc is not None:
            code = proc.wait(timeout=5)
            if self._stderr_thread is not None:
                self._stderr_thread.join(timeout=2)
            if code != 0:
                tail = "; ".join(self._stderr) or "no message"
                raise AlsaCaptureError(f"arecord on {self.config.device!r} exited with status {code}: {tail}")

    def _recording(self, seg: Segment) -> WeldRecording:
        cfg = self.config
        self._t0_frozen = True  # one time base per capture: stamps stay monotonic and unique
        started = datetime.fromtimestamp(self._t0 or 0.0, UTC) + timedelta(
            seconds=seg.start / cfg.sample_rate
        )
        channels, data = cfg.channels, seg.data
        if cfg.drop_trigger:
            keep = [i for i, c in enumerate(cfg.channels) if c != (cfg.trigger_channel or cfg.channels[0])]
            channels, data = tuple(cfg.channels[i] for i in keep), data[keep]
        stamp = started.strftime("%Y%m%dT%H%M%S.%f")
        return WeldRecording(
            data=data,
            channels=channels,
            sample_rate=float(cfg.sample_rate),
            weld_id=f"{cfg.weld_id_prefix}-{stamp}",
            started_at=started,
            source=f"alsa:{cfg.device}",
            meta={"stream_sample": seg.start, "truncated": seg.truncated, "format": cfg.sample_format},
            min_sample_rate=cfg.min_sample_rate,
        )

    def close(self) -> None:
        """Stop ``arecord`` (SIGTERM, then SIGKILL after 2 s) and release its pipes."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=2)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        if self._stderr_thread is not None:
            self._stderr_thread.join(timeout=2)
            self._stderr_thread = None

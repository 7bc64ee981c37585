"""Cut a continuous multi-channel stream into welds by the energy of a trigger channel.

A weld starts when the RMS of one frame (1 ms by default) of the trigger channel
reaches ``on_rms`` and ends after ``hangover_s`` of frames below ``off_rms``
(hysteresis, so the weld's own amplitude wobble does not split it).  Each segment
keeps ``pre_s`` before the first loud frame and ``post_s`` after the last one.
Segments shorter than ``min_weld_s`` (a knock, a dropped tool) are dropped; a weld
reaching ``max_weld_s`` is cut there and the segmenter waits for quiet before
starting another.  The trigger channel can be a microphone or AE channel, or a
dedicated line carrying the welder's "sonics on" signal.

The segmenter is pure (no I/O): feed it blocks, collect :class:`Segment` objects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmenterConfig:
    """Thresholds and timing of :class:`EnergySegmenter` (RMS in the stream's units)."""

    sample_rate: float
    on_rms: float = 0.05
    off_rms: float = 0.02
    frame_s: float = 0.001
    hangover_s: float = 0.05
    pre_s: float = 0.01
    post_s: float = 0.01
    min_weld_s: float = 0.1
    max_weld_s: float = 5.0

    def errors(self) -> list[str]:
        """Every problem with these settings (empty when valid)."""
        out = []
        if not self.sample_rate > 0:
            out.append(f"sample_rate must be > 0 (got {self.sample_rate})")
        if not 0 < self.off_rms <= self.on_rms:
            out.append(f"need 0 < off_rms <= on_rms (got off {self.off_rms}, on {self.on_rms})")
        if not 0 < self.frame_s <= self.min_weld_s:
            out.append(f"need 0 < frame_s <= min_weld_s (got {self.frame_s}, {self.min_weld_s})")
        if not 0 <= self.post_s <= self.hangover_s:
            out.append(f"need 0 <= post_s <= hangover_s (got {self.post_s}, {self.hangover_s})")
        if self.pre_s < 0:
            out.append(f"pre_s must be >= 0 (got {self.pre_s})")
        if not self.min_weld_s < self.max_weld_s:
            out.append(f"need min_weld_s < max_weld_s (got {self.min_weld_s}, {self.max_weld_s})")
        return out


@dataclass(frozen=True)
class Segment:
    """One weld cut from the stream: ``data[:, 0]`` is stream sample ``start``."""

    start: int
    data: np.ndarray
    truncated: bool = False


class EnergySegmenter:
    """Stateful weld segmentation over a stream of ``(n_channels, n)`` blocks.

    Parameters
    ----------
    config
        Thresholds and timing.
    trigger
        Row of the block whose energy triggers.
    """

    def __init__(self, config: SegmenterConfig, trigger: int = 0) -> None:
        problems = config.errors()
        if problems:
            raise ValueError("invalid SegmenterConfig: " + "; ".join(problems))
        fs = config.sample_rate
        self.config = config
        self.trigger = trigger
        self.frame_n = max(1, round(config.frame_s * fs))
        self.hang_frames = max(1, round(config.hangover_s / config.frame_s))
        self.pre_n = round(config.pre_s * fs)
        self.post_n = round(config.post_s * fs)
        self.min_n = round(config.min_weld_s * fs)
        self.max_n = round(config.max_weld_s * fs)
        self._chunks: list[np.ndarray] = []
        self._chunks_start = 0  # stream index of the first kept sample
        self._kept = 0
        self._framed = 0  # stream index up to which frames were evaluated
        self._trig_tail = np.empty(0)  # trigger samples from _framed on
        self._active = False
        self._cooldown = False
        self._start = 0
        self._last_loud_end = 0
        self._quiet = 0

    @property
    def position(self) -> int:
        """Samples fed so far."""
        return self._chunks_start + self._kept

    def feed(self, block: np.ndarray) -> list[Segment]:
        """Add a block; return the welds completed by it."""
        block = np.asarray(block, dtype=np.float64)
        if block.ndim != 2 or block.shape[0] <= self.trigger:
            raise ValueError(f"blocks must be (n_channels > {self.trigger}, n); got {block.shape}")
        if block.shape[1] == 0:
            return []
        self._chunks.append(block)
        self._kept += block.shape[1]
        out: list[Segment] = []
        trig = np.concatenate([self._trig_tail, block[self.trigger]])
        n_frames = len(trig) // self.frame_n
        if n_frames:
            used = n_frames * self.frame_n
            rms = np.sqrt(np.mean(trig[:used].reshape(n_frames, self.frame_n) ** 2, axis=1))
            for j, level in enumerate(rms):
                seg = self._step(self._framed + j * self.frame_n, float(level))
                if seg is not None:
                    out.append(seg)
            self._framed += used
            trig = trig[used:]
        self._trig_tail = trig
        self._trim()
        return out

    def flush(self) -> list[Segment]:
        """End of stream: emit a weld still in progress if long enough."""
        if not self._active:
            return []
        self._active = False
        end = min(self._last_loud_end + self.post_n, self.position)
        seg = self._emit(end, truncated=True)
        return [seg] if seg is not None else []

    def _step(self, frame_start: int, level: float) -> Segment | None:
        frame_end = frame_start + self.frame_n
        if self._cooldown:
            if level < self.config.off_rms:
                self._quiet += 1
                if self._quiet >= self.hang_frames:
                    self._cooldown = False
            else:
                self._quiet = 0
            return None
        if not self._active:
            if level >= self.config.on_rms:
                self._active, self._start, self._last_loud_end, self._quiet = True, frame_start, frame_end, 0
            return None
        if level >= self.config.off_rms:
            self._quiet, self._last_loud_end = 0, frame_end
            if frame_end - self._start >= self.max_n:
                log.warning("weld reached max_weld_s=%g s; cut there", self.config.max_weld_s)
                self._active, self._cooldown, self._quiet = False, True, 0
                return self._emit(frame_end, truncated=True)
            return None
        self._quiet += 1
        if self._quiet < self.hang_frames:
            return None
        self._active = False
        return self._emit(self._last_loud_end + self.post_n, truncated=False)

    def _emit(self, end: int, *, truncated: bool) -> Segment | None:
        if self._last_loud_end - self._start < self.min_n:
            log.debug(
                "dropped a %.3f s burst shorter than min_weld_s",
                (self._last_loud_end - self._start) / self.config.sample_rate,
            )
            return None
        begin = max(self._start - self.pre_n, self._chunks_start)
        end = min(end, self.position)
        return Segment(begin, self._slice(begin, end).copy(), truncated)

    def _slice(self, a: int, b: int) -> np.ndarray:
        """Stream samples ``[a, b)`` from the kept chunks (consolidating them)."""
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks, axis=1)]
        return self._chunks[0][:, a - self._chunks_start : b - self._chunks_start]

    def _trim(self) -> None:
        """Forget samples no future segment can need."""
        keep_from = self._framed - self.pre_n if not self._active else self._start - self.pre_n
        drop = keep_from - self._chunks_start
        if drop <= 0 or (not self._active and drop < 4 * self.frame_n and len(self._chunks) < 64):
            return
        whole = self._slice(self._chunks_start, self.position)
        self._chunks = [whole[:, drop:]]
        self._chunks_start += drop
        self._kept -= drop

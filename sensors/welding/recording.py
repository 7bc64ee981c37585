"""One recorded ultrasonic weld: the channels, their sample rate and where the weld came from.

A :class:`WeldRecording` is what every welding source (watched folder, ALSA, simulator)
hands on and what :mod:`sensors.features.dwt` turns into a feature row.  It is
validated once, on construction, so downstream code can trust its shape and values.

Channels follow FTL-TP §3.2: the welder's built-in power sensor and LVDT, an acoustic
emission (AE) sensor and a microphone, sampled above 200 kHz.  A source may deliver a
subset (an ALSA capture of the microphone alone), in which case the feature schema
must name the same subset.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

import numpy as np

#: Canonical channel names, in the order the default feature schema uses.
WELD_CHANNELS: tuple[str, ...] = ("power", "lvdt", "ae", "mic")
#: FTL-TP's monitoring system samples every channel above 200 kHz.
MIN_SAMPLE_RATE = 200_000.0

_CHANNEL_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_WELD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class WeldDataError(ValueError):
    """A weld recording (or the file it came from) is malformed; the message says how."""


class SourceConfigError(ValueError):
    """A weld source's settings (``AlsaConfig``, ``FolderSourceConfig``) are invalid; the message lists
    every failing field.  Not ``ioft_protocol.config.ConfigError`` (a TOML file's fields): sensors
    imports no other package, and these settings come from Python, not from a file."""


@dataclass(frozen=True, eq=False)
class WeldRecording:
    """A validated multi-channel recording of one weld.

    Parameters
    ----------
    data
        Samples, shape ``(n_channels, n_samples)``, converted to float64 in physical
        units (or full-scale units, 1.0 = full scale, where the source knows no scale).
    channels
        One lowercase name per row of ``data`` (see :data:`WELD_CHANNELS`).
    sample_rate
        Samples per second per channel.
    weld_id
        Identifier unique per weld on this machine (letters, digits, ``._:-``).
    started_at
        Timezone-aware time of the first sample; stored in UTC.
    source
        Where the weld came from (file path, ALSA device, ``"sim"``), for logs.
    meta
        Free-form extra metadata, copied on construction; treat it as read-only
        (values should be JSON-serialisable).
    min_sample_rate
        Lowest acceptable rate; 200 kHz unless a caller (the simulator's fast mode)
        deliberately records slower.

    Raises
    ------
    WeldDataError
        If the shape, values, channel names, rate, id or timestamp are invalid.
    """

    data: np.ndarray
    channels: tuple[str, ...]
    sample_rate: float
    weld_id: str
    started_at: datetime
    source: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)
    min_sample_rate: float = field(default=MIN_SAMPLE_RATE, repr=False)

    def __post_init__(self) -> None:
        channels = _checked_channels(self.channels)
        data = _checked_data(self.data, channels)
        data.setflags(write=False)
        rate = _positive_float(self.sample_rate, "sample_rate")
        min_rate = _positive_float(self.min_sample_rate, "min_sample_rate")
        if rate < min_rate:
            raise WeldDataError(
                f"sample rate {rate:g} Hz is below the required {min_rate:g} Hz; the 20 kHz "
                "weld carrier, its harmonics and AE bursts need >= 200 kHz sampling"
            )
        if not isinstance(self.weld_id, str) or not _WELD_ID.match(self.weld_id):
            raise WeldDataError(
                "invalid weld_id: 1-128 characters of letters, digits and '._:-', "
                "starting with a letter or digit"
            )
        started = self.started_at
        if not isinstance(started, datetime) or started.tzinfo is None:
            raise WeldDataError(
                f"started_at must be a timezone-aware datetime; got {started!r} "
                "(use datetime.now(UTC) or attach the welder's time zone)"
            )
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "channels", channels)
        object.__setattr__(self, "sample_rate", rate)
        object.__setattr__(self, "min_sample_rate", min_rate)
        object.__setattr__(self, "started_at", started.astimezone(UTC))
        object.__setattr__(self, "meta", dict(self.meta))  # a private copy (a proxy would not pickle)

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # Unpickling goes through __init__ again: validated, read-only data.
        return (
            type(self),
            (
                self.data,
                self.channels,
                self.sample_rate,
                self.weld_id,
                self.started_at,
                self.source,
                self.meta,
                self.min_sample_rate,
            ),
        )

    @property
    def n_samples(self) -> int:
        """Samples per channel."""
        return int(self.data.shape[1])

    @property
    def duration(self) -> float:
        """Length of the recording in seconds."""
        return self.n_samples / self.sample_rate

    @property
    def ended_at(self) -> datetime:
        """Time just after the last sample (UTC)."""
        return self.started_at + timedelta(seconds=self.duration)

    def channel(self, name: str) -> np.ndarray:
        """The samples of one channel (read-only view)."""
        try:
            return self.data[self.channels.index(name)]
        except ValueError:
            raise KeyError(f"no channel {name!r} in this weld; it has {', '.join(self.channels)}") from None

    def select(self, names: Sequence[str]) -> np.ndarray:
        """Rows for ``names`` in that order, shape ``(len(names), n_samples)``.

        Raises
        ------
        WeldDataError
            Naming every requested channel the recording lacks.
        """
        missing = [n for n in names if n not in self.channels]
        if missing:
            raise WeldDataError(
                f"weld {self.weld_id} lacks channel(s) {missing}; it has {list(self.channels)}"
            )
        if tuple(names) == self.channels:
            return self.data
        return self.data[[self.channels.index(n) for n in names]]


def _positive_float(value: object, name: str) -> float:
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise WeldDataError(f"{name} must be a number; got {type(value).__name__}") from None
    if not math.isfinite(out) or out <= 0:
        raise WeldDataError(f"{name} must be a positive finite number; got {out:g}")
    return out


def parse_timestamp(value: object, *, what: str = "timestamp", assume_tz: tzinfo = UTC) -> datetime:
    """Parse an ISO 8601 timestamp (or a ``datetime``) into an aware UTC datetime.

    Parameters
    ----------
    value
        ``"2024-05-01T08:30:00Z"``, ``"2024-05-01 08:30:00+02:00"`` or a datetime.
    what
        Name used in the error message.
    assume_tz
        Zone for naive timestamps (operators' logs often omit it).

    Raises
    ------
    WeldDataError
        If ``value`` is not a parsable timestamp.
    """
    if isinstance(value, datetime):
        stamp = value
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            stamp = datetime.fromisoformat(text)
        except ValueError:
            raise WeldDataError(
                f"{what} {value!r} is not an ISO 8601 time such as 2024-05-01T08:30:00Z"
            ) from None
    else:
        raise WeldDataError(f"{what} must be an ISO 8601 string; got {value!r}")
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=assume_tz)
    return stamp.astimezone(UTC)


def _checked_channels(names: Sequence[str]) -> tuple[str, ...]:
    """The channel names as a tuple; refuses invalid or repeated names (counted, never quoted)."""
    channels = tuple(names)
    # Names are counted by position, not quoted: they may come from any file's first line.
    bad = [i for i, c in enumerate(channels) if not isinstance(c, str) or not _CHANNEL_NAME.match(c)]
    if bad:
        raise WeldDataError(
            f"invalid channel name(s) at position(s) {bad}: use lowercase letters, digits and '_' "
            f"(the standard names are {', '.join(WELD_CHANNELS)})"
        )
    if len(set(channels)) != len(channels):
        raise WeldDataError(f"duplicate channel names among the {len(channels)}")
    return channels


def _checked_data(raw: Any, channels: tuple[str, ...]) -> np.ndarray:
    """A float64 C-ordered copy of ``raw``, one finite row of at least 2 samples per channel."""
    data = np.asarray(raw)
    if data.ndim != 2:
        raise WeldDataError(f"weld data must be 2-D (n_channels, n_samples); got shape {data.shape}")
    if data.shape[0] != len(channels):
        raise WeldDataError(
            f"weld data has {data.shape[0]} channel row(s) but {len(channels)} channel "
            "name(s); data must be shaped (n_channels, n_samples)"
        )
    if data.shape[1] < 2:
        raise WeldDataError(f"weld has {data.shape[1]} sample(s) per channel; need at least 2")
    if not (np.issubdtype(data.dtype, np.floating) or np.issubdtype(data.dtype, np.integer)):
        raise WeldDataError(f"weld data must be numeric; got dtype {data.dtype}")
    data = np.array(data, dtype=np.float64, order="C", copy=True)
    finite = np.isfinite(data)
    if not finite.all():
        rows = [channels[i] for i in np.flatnonzero(~finite.all(axis=1))]
        first = int(np.argmin(finite.all(axis=0)))
        raise WeldDataError(
            f"weld data has {int((~finite).sum())} non-finite value(s) (NaN/inf) in "
            f"channel(s) {rows}, first at sample {first}"
        )
    return data

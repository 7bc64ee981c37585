"""Weld files as monitoring systems export them: WAV, NPY and CSV, each with an optional JSON sidecar.

One weld per file.  The sidecar ``<stem>.json`` beside ``<stem>.wav|.npy|.csv`` carries
what the data file cannot::

    {
      "weld_id": "L20-000123",                  # default: the file stem
      "started_at": "2024-05-01T08:30:00.125Z", # default: file mtime minus the duration
      "channels": ["power", "lvdt", "ae", "mic"],
      "sample_rate": 200000,                     # WAV: must agree with the header
      "scale": {"power": 4000.0, "lvdt": 0.5},   # multiply to get physical units
      "units": {"power": "W", "lvdt": "mm"}      # anything else lands in ``meta``
    }

Per format:

* **WAV** (int16/int24/int32/float32/float64, plain, IEEE float or EXTENSIBLE): rate
  from the header, channel names from the sidecar or the reader's default order.
* **NPY**: needs the sidecar for ``channels`` and ``sample_rate``; the array may be
  ``(n_channels, n_samples)`` or ``(n_samples, n_channels)``.
* **CSV**: a header row of channel names; the rate from a ``# sample_rate: 200000``
  comment line, the sidecar, or a ``time``/``time_s`` column.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from sensors.files import (
    DEFAULT_MAX_FILE_BYTES,
    SIDECAR_MAX_BYTES,
    FileRefusedError,
    printable,
    read_capped,
)
from sensors.welding.recording import (
    MIN_SAMPLE_RATE,
    WELD_CHANNELS,
    WeldDataError,
    WeldRecording,
    parse_timestamp,
)
from sensors.welding.tables import read_csv, read_npy
from sensors.welding.wavfile import IncompleteWeldFileError, read_wav, write_wav

log = logging.getLogger(__name__)

WELD_SUFFIXES = (".wav", ".npy", ".csv")
_SIDECAR_KEYS = ("weld_id", "started_at", "channels", "sample_rate", "scale")


def sidecar_path(path: str | Path) -> Path:
    """``<stem>.json`` beside a weld file."""
    path = Path(path)
    return path.with_name(path.stem + ".json")


def read_sidecar(path: str | Path) -> dict[str, Any]:
    """The weld file's JSON sidecar as a dict (empty when there is none; a link to one is refused)."""
    side = sidecar_path(path)
    if not os.path.lexists(side):
        return {}
    try:
        text = read_capped(side, SIDECAR_MAX_BYTES).decode("utf-8")
    except FileRefusedError as exc:
        raise WeldDataError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise WeldDataError(f"{side}: not UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        if not text.strip() or exc.pos >= len(text.rstrip()):
            raise IncompleteWeldFileError(f"{side}: JSON ends early (still being written?)") from exc
        raise WeldDataError(
            f"{side}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    if not isinstance(obj, dict):
        raise WeldDataError(f"{side}: sidecar must be a JSON object, got {type(obj).__name__}")
    return obj


def read_weld_file(
    path: str | Path,
    *,
    default_channels: Sequence[str] = WELD_CHANNELS,
    min_sample_rate: float = MIN_SAMPLE_RATE,
    max_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> WeldRecording:
    """Read one exported weld (WAV, NPY or CSV plus optional sidecar).

    A link, a file of another kind, or one over ``max_bytes`` (on disk, or as its header
    declares) is refused before anything is allocated; no message quotes the file's contents.

    Parameters
    ----------
    path
        The data file.
    default_channels
        Channel order assumed for a WAV without a sidecar naming its channels.
    min_sample_rate
        Passed to :class:`WeldRecording`.
    max_bytes
        The cap on the file's size and on the data its header declares.

    Raises
    ------
    IncompleteWeldFileError
        If the file (or its sidecar) looks unfinished: keep waiting.
    WeldDataError
        If the file can never be read: reject it with the message as the reason.
    """
    path = Path(path)
    try:
        return _read_weld_file(path, default_channels, min_sample_rate, max_bytes)
    except WeldDataError:
        raise
    except FileRefusedError as exc:
        raise WeldDataError(str(exc)) from None
    except (TypeError, ValueError, AttributeError) as exc:  # a sidecar field of the wrong type, say
        # the exception's text is not passed on: float('<a line of the file>') would quote it
        raise WeldDataError(
            f"{printable(path)}: a sidecar field or value of the wrong type ({type(exc).__name__})"
        ) from None


def _read_weld_file(
    path: Path, default_channels: Sequence[str], min_sample_rate: float, max_bytes: int
) -> WeldRecording:
    data, channels, rate, side, meta = _read_table(path, read_sidecar(path), default_channels, max_bytes)
    channels = _channel_list(channels, path)
    data = _apply_scale(data, channels, side.get("scale"), path)
    meta.update({k: v for k, v in side.items() if k not in _SIDECAR_KEYS})
    if "weld_id" not in side:
        meta["weld_id_source"] = "file name"
    duration = data.shape[-1] / rate if rate > 0 else 0.0
    started = _started_at(path, side, duration, meta)
    try:
        return WeldRecording(
            data=data,
            channels=tuple(channels),
            sample_rate=rate,
            weld_id=str(side.get("weld_id", path.stem)),
            started_at=started,
            source=str(path),
            meta=meta,
            min_sample_rate=min_sample_rate,
        )
    except WeldDataError as exc:
        raise WeldDataError(f"{path}: {exc}") from exc


def _read_table(
    path: Path, side: dict[str, Any], default_channels: Sequence[str], max_bytes: int
) -> tuple[np.ndarray, object, float, dict[str, Any], dict[str, Any]]:
    """The file's data, channel names and rate by its format; the sidecar (a CSV's comments
    beneath it) and the format as the start of ``meta``."""
    suffix = path.suffix.lower()
    if suffix == ".wav":
        data, info = read_wav(path, max_bytes=max_bytes)
        rate: float = float(info.sample_rate)
        if "sample_rate" in side and not np.isclose(float(side["sample_rate"]), rate):
            raise WeldDataError(f"{path}: sidecar sample_rate disagrees with the WAV header {rate:g}")
        channels = side.get("channels") or _default_channels(default_channels, data.shape[0], path)
        return data, channels, rate, side, {"format": f"wav/{info.sample_format}"}
    if suffix == ".npy":
        if "channels" not in side or "sample_rate" not in side:
            missing = [k for k in ("channels", "sample_rate") if k not in side]
            raise WeldDataError(f"{path}: NPY welds need a sidecar {sidecar_path(path).name} with {missing}")
        data, channels, rate = read_npy(path, side, max_bytes)
        return data, channels, rate, side, {"format": "npy"}
    if suffix == ".csv":
        data, channels, rate, comments = read_csv(path, side, max_bytes)
        return data, channels, rate, {**comments, **side}, {"format": "csv"}
    raise WeldDataError(f"{path}: unsupported weld file type {suffix!r}; use one of {WELD_SUFFIXES}")


def _started_at(path: Path, side: Mapping[str, Any], duration: float, meta: dict[str, Any]) -> datetime:
    """The sidecar's start time, else the file's mtime minus the duration (noted in ``meta``)."""
    if "started_at" in side:
        try:
            return parse_timestamp(side["started_at"])
        except WeldDataError:  # its message quotes the value
            raise WeldDataError(
                f"{path}: sidecar started_at is not an ISO 8601 time such as 2024-05-01T08:30:00Z"
            ) from None
    mtime = datetime.fromtimestamp(path.stat().st_mtime, UTC)
    meta["started_at_source"] = "file mtime minus duration"
    return mtime - timedelta(seconds=duration)


def _default_channels(default: Sequence[str], n: int, path: Path) -> list[str]:
    if len(default) != n:
        raise WeldDataError(
            f"{path}: {n} channel(s) but no sidecar naming them and the default order has "
            f'{len(default)} ({list(default)}); write {sidecar_path(path).name} with "channels"'
        )
    return list(default)


def _channel_list(channels: object, path: Path) -> list[str]:
    if not isinstance(channels, list | tuple) or not all(isinstance(c, str) for c in channels):
        raise WeldDataError(f"{path}: channels must be a list of names, got {type(channels).__name__}")
    return [c.strip().lower() for c in channels]


def _apply_scale(data: np.ndarray, channels: list[str], scale: object, path: Path) -> np.ndarray:
    if scale is None:
        return data
    if isinstance(scale, Mapping):
        unknown = set(scale) - set(channels)
        if unknown:  # counted, not quoted: the names come from the files
            raise WeldDataError(f"{path}: scale names {len(unknown)} channel(s) the data does not have")
        factors = [float(scale.get(c, 1.0)) for c in channels]
    elif isinstance(scale, list | tuple) and len(scale) == len(channels):
        factors = [float(s) for s in scale]
    else:
        raise WeldDataError(
            f"{path}: scale must map channel -> factor or list one factor per channel; "
            f"got {type(scale).__name__}"
        )
    if not all(np.isfinite(f) and f != 0 for f in factors):
        raise WeldDataError(f"{path}: scale factors must be finite and non-zero")
    return data * np.asarray(factors)[:, None]


def write_weld_file(
    recording: WeldRecording,
    path: str | Path,
    *,
    sample_format: str = "float32",
    extensible: bool = False,
) -> Path:
    """Export a weld the way a monitoring system would, data file plus sidecar.

    The data file is written first and the sidecar last, so a reader that waits for
    the sidecar never sees a half-written weld.  Integer WAV formats store each
    channel scaled to its own full scale; the factors go to the sidecar's ``scale``.

    Parameters
    ----------
    recording
        The weld to write.
    path
        Target file; its suffix picks the format (``.wav``, ``.npy``, ``.csv``).
    sample_format
        WAV sample format (see :data:`sensors.welding.wavfile.SAMPLE_FORMATS`).
    extensible
        Write a ``WAVE_FORMAT_EXTENSIBLE`` WAV header.

    Returns
    -------
    Path
        The data file.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    side: dict[str, Any] = {
        "weld_id": recording.weld_id,
        "started_at": recording.started_at.isoformat().replace("+00:00", "Z"),
        "channels": list(recording.channels),
        "sample_rate": recording.sample_rate,
    }
    if suffix not in WELD_SUFFIXES:
        raise ValueError(f"unsupported weld file type {suffix!r}; use one of {WELD_SUFFIXES}")
    try:
        _write_weld(recording, path, side, sample_format, extensible)
    except OSError as exc:  # a full disk: numpy says only "120000 requested and 16352 written"
        for partial in (path, sidecar_path(path)):
            partial.unlink(missing_ok=True)  # half a weld would fill the disk and read as a weld
        raise OSError(
            f"cannot write {path}: {exc.strerror or exc} (partial file removed); "
            f"free space on the disk holding {path.parent}, then start again"
        ) from None
    return path


def _write_weld(
    recording: WeldRecording, path: Path, side: dict[str, Any], sample_format: str, extensible: bool
) -> None:
    """The data file, then the sidecar (:func:`write_weld_file`)."""
    suffix = path.suffix.lower()
    data = recording.data
    if suffix == ".wav":
        if not float(recording.sample_rate).is_integer():
            raise ValueError(f"WAV needs an integer sample rate; got {recording.sample_rate}")
        if sample_format.startswith("int"):
            peak = np.abs(data).max(axis=1)
            bits = {"int16": 16, "int24": 24, "int32": 32}[sample_format]
            # Map the peak to the largest positive code (not +1.0, which would clip by 1 LSB).
            scale = np.where(peak > 0, peak, 1.0) / (1.0 - 2.0 ** -(bits - 1))
            side["scale"] = dict(zip(recording.channels, scale.tolist(), strict=True))
            data = data / scale[:, None]
        write_wav(path, data, int(recording.sample_rate), sample_format=sample_format, extensible=extensible)
    elif suffix == ".npy":
        np.save(path, data.astype(np.float32 if sample_format == "float32" else np.float64))
    elif suffix == ".csv":
        buf = io.StringIO()
        buf.write(f"# sample_rate: {recording.sample_rate:g}\n")
        buf.write(",".join(recording.channels) + "\n")
        np.savetxt(buf, data.T, delimiter=",", fmt="%.9g")
        path.write_text(buf.getvalue(), encoding="utf-8")
    extra = {k: v for k, v in recording.meta.items() if k not in side and _jsonable(v)}
    sidecar_path(path).write_text(json.dumps({**extra, **side}, indent=1), encoding="utf-8")


def _jsonable(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True

"""NPY and CSV weld files: the bytes of one weld to a ``(channels, samples)`` table.

Called by :func:`sensors.welding.formats.read_weld_file`, which adds the sidecar, the scale and
the recording around the table.  Both readers refuse a file over ``max_bytes`` before allocating
and never quote its contents in a message.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from tokenize import TokenError
from typing import Any

import numpy as np

from sensors.files import check_size, read_capped
from sensors.welding.recording import WeldDataError
from sensors.welding.wavfile import IncompleteWeldFileError

log = logging.getLogger(__name__)

MAX_FILE_SETTING = "max_file_bytes"  # named in a refusal: the setting that raises the cap
TIME_COLUMNS = ("time", "time_s", "t")
_COMMENT_KV = re.compile(r"^#\s*([A-Za-z_]+)\s*[:=]\s*(.+?)\s*$")
_AT_ROW = re.compile(r"at row (\d+), column (\d+)")


def read_npy(path: Path, side: Mapping[str, Any], max_bytes: int) -> tuple[np.ndarray, list[str], float]:
    """An NPY weld's table, channel names and sample rate (the names and rate from ``side``)."""
    raw = read_capped(path, max_bytes, setting=MAX_FILE_SETTING)
    with io.BytesIO(raw) as fh:
        try:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise WeldDataError(
                    f"{path}: NPY format version {version} is not supported; save with np.save"
                )
        except WeldDataError:
            raise
        except (ValueError, SyntaxError, TokenError) as exc:  # numpy parses the header with tokenize
            if len(raw) < 128:
                raise IncompleteWeldFileError(f"{path}: NPY header incomplete") from exc
            raise WeldDataError(f"{path}: not a NumPy .npy file") from None  # numpy's text quotes it
        header_end = fh.tell()
    if dtype.hasobject or dtype.kind not in "biuf":  # complex, strings, dates: not samples
        raise WeldDataError(f"{path}: {dtype} arrays are not weld data")
    declared = int(np.prod(shape, dtype=object)) * dtype.itemsize  # Python ints: no overflow
    check_size(path, declared, max_bytes, what="its header declares", setting=MAX_FILE_SETTING)
    expected = header_end + declared
    size = len(raw)
    if size < expected:
        raise IncompleteWeldFileError(f"{path}: {size} of {expected} bytes present")
    if size > expected:
        raise WeldDataError(f"{path}: {size - expected} trailing bytes after the array")
    arr = np.load(io.BytesIO(raw), allow_pickle=False)
    channels = list(side["channels"])
    if arr.ndim != 2:
        raise WeldDataError(f"{path}: array must be 2-D (channels x samples); got shape {arr.shape}")
    n = len(channels)
    if arr.shape[0] == n and arr.shape[1] != n:
        data = arr
    elif arr.shape[1] == n and arr.shape[0] != n:
        data = arr.T
    else:
        raise WeldDataError(
            f"{path}: array shape {arr.shape} does not match {n} channel names {channels} unambiguously"
        )
    return np.asarray(data, dtype=np.float64), channels, float(side["sample_rate"])


def read_csv(
    path: Path, side: Mapping[str, Any], max_bytes: int
) -> tuple[np.ndarray, list[str], float, dict[str, Any]]:
    """A CSV weld's table, channel names, sample rate and ``# key: value`` comment lines."""
    try:
        text = read_capped(path, max_bytes, setting=MAX_FILE_SETTING).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WeldDataError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if text and not text.endswith("\n"):
        raise IncompleteWeldFileError(f"{path}: last line has no newline (still being written?)")
    header, comments, body_start = _csv_header(text, path)
    if not text[body_start:].strip():  # a writer caught between its header and its first row
        raise IncompleteWeldFileError(f"{path}: a header and no rows yet (still being written?)")
    try:
        table = np.loadtxt(io.StringIO(text[body_start:]), delimiter=",", ndmin=2, dtype=np.float64)
    except ValueError as exc:  # numpy's text quotes the value; only where it is is passed on
        where = _AT_ROW.search(str(exc))
        at = f" at data row {int(where[1]) + 1}, column {int(where[2]) + 1}" if where else ""
        raise WeldDataError(f"{path}: unreadable CSV body (not a number{at})") from None
    if table.shape[1] != len(header):
        raise WeldDataError(f"{path}: {table.shape[1]} columns of data but header has {len(header)}")
    time_idx = [i for i, h in enumerate(header) if h in TIME_COLUMNS]
    rate = _csv_rate(path, table, time_idx, side.get("sample_rate", comments.get("sample_rate")))
    keep = [i for i in range(len(header)) if i not in time_idx]
    channels = [header[i] for i in keep]
    return np.ascontiguousarray(table[:, keep].T), channels, rate, comments


def _csv_header(text: str, path: Path) -> tuple[list[str], dict[str, Any], int]:
    """The header row's channel names, the comment lines above it, and where the numbers start."""
    comments: dict[str, Any] = {}
    header: list[str] | None = None
    body_start = 0
    for i, line in enumerate(text.splitlines(keepends=True)):
        stripped = line.strip()
        if stripped.startswith("#"):
            m = _COMMENT_KV.match(stripped)
            if m:
                comments[m.group(1).lower()] = m.group(2)
            body_start += len(line)
            continue
        if not stripped:
            body_start += len(line)
            continue
        header = [h.strip().strip('"').lower() for h in stripped.split(",")]
        body_start += len(line)
        log.debug("%s: header on line %d", path, i + 1)
        break
    if header is None:
        raise WeldDataError(f"{path}: no header row of channel names")
    return header, comments, body_start


def _csv_rate(path: Path, table: np.ndarray, time_idx: list[int], rate_text: Any) -> float:
    """The sample rate as the sidecar or a comment gives it, else from the time column."""
    if rate_text is not None:
        try:
            return float(rate_text)
        except ValueError:
            raise WeldDataError(f"{path}: sample_rate is not a number") from None
    if time_idx and table.shape[0] > 2:
        step = float(np.median(np.diff(table[:, time_idx[0]])))
        if not step > 0:
            raise WeldDataError(f"{path}: time column does not increase; cannot derive the sample rate")
        return round(1.0 / step, 3)
    raise WeldDataError(
        f"{path}: no sample rate; add a '# sample_rate: 200000' line, a sidecar, or a time column"
    )

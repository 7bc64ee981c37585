"""Multi-channel WAV reading and writing for weld exports.

Python 3.11's :mod:`wave` reads only ``WAVE_FORMAT_PCM`` (tag 1).  Welder monitoring
systems and DAQ tools also write ``WAVE_FORMAT_IEEE_FLOAT`` (tag 3) and
``WAVE_FORMAT_EXTENSIBLE`` (tag 0xFFFE, required by the spec for more than two
channels or more than 16 bits), so this module parses the RIFF chunk list itself,
hands plain PCM to :mod:`wave` and decodes the other two directly.

Integer samples are returned in full-scale units (``int16`` 32767 -> ~1.0); float
samples are returned as stored.  A file whose header promises more data than it
holds raises :class:`IncompleteWeldFileError` so the folder source can wait for the
writer to finish instead of rejecting the file.
"""

from __future__ import annotations

import io
import struct
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sensors.files import DEFAULT_MAX_FILE_BYTES, FileRefusedError, check_size, read_capped
from sensors.welding.recording import WeldDataError

WAVE_FORMAT_PCM = 0x0001
WAVE_FORMAT_IEEE_FLOAT = 0x0003
WAVE_FORMAT_EXTENSIBLE = 0xFFFE
# KSDATAFORMAT_SUBTYPE_* GUIDs end in these 14 bytes; the first two are the format tag.
_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
SAMPLE_FORMATS = ("int16", "int24", "int32", "float32", "float64")


class IncompleteWeldFileError(WeldDataError):
    """The file ends before its header says it should: still being written, or truncated."""


@dataclass(frozen=True)
class WavInfo:
    """What the ``fmt `` chunk says about a WAV file."""

    format_tag: int
    n_channels: int
    sample_rate: int
    bits_per_sample: int
    n_frames: int
    extensible: bool = False

    @property
    def sample_format(self) -> str:
        """One of :data:`SAMPLE_FORMATS` (``uint8`` for 8-bit PCM)."""
        if self.format_tag == WAVE_FORMAT_IEEE_FLOAT:
            return f"float{self.bits_per_sample}"
        return "uint8" if self.bits_per_sample == 8 else f"int{self.bits_per_sample}"


def _chunks(raw: bytes, path: Path) -> dict[bytes, tuple[int, int]]:
    """Map chunk id -> (offset, declared size) for the top-level RIFF chunks."""
    if len(raw) < 12:
        raise IncompleteWeldFileError(f"{path}: {len(raw)} bytes, shorter than a WAV header")
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise WeldDataError(f"{path}: not a RIFF/WAVE file")  # its bytes are not quoted: it may be anything
    chunks: dict[bytes, tuple[int, int]] = {}
    pos = 12
    while pos + 8 <= len(raw):
        cid, size = raw[pos : pos + 4], struct.unpack_from("<I", raw, pos + 4)[0]
        chunks.setdefault(cid, (pos + 8, size))
        if cid == b"data":
            break  # data is last in every writer we know; its size may be a placeholder
        pos += 8 + size + (size & 1)
    return chunks


def read_wav_info(path: str | Path, *, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> WavInfo:
    """Parse and check the header of a WAV file.

    Raises
    ------
    IncompleteWeldFileError
        If the ``fmt ``/``data`` chunks are missing or the data is shorter than declared.
    WeldDataError
        If the file is not a WAV this module can decode.
    """
    path = Path(path)
    return _parse(_read(path, max_bytes), path, max_bytes)[0]


def _read(path: Path, max_bytes: int) -> bytes:
    """The file's bytes: no link followed, nothing read past the cap (:mod:`sensors.files`)."""
    try:
        return read_capped(path, max_bytes, setting="max_file_bytes")
    except FileRefusedError as exc:
        raise WeldDataError(str(exc)) from None


def _parse(raw: bytes, path: Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> tuple[WavInfo, int, int]:
    """``(info, data_offset, data_bytes)`` from the whole file's bytes."""
    chunks = _chunks(raw, path)
    if b"fmt " not in chunks or b"data" not in chunks:
        raise IncompleteWeldFileError(f"{path}: no {'fmt ' if b'fmt ' not in chunks else 'data'} chunk yet")
    off, size = chunks[b"fmt "]
    if size < 16 or off + size > len(raw):
        raise WeldDataError(f"{path}: fmt chunk of {size} bytes is malformed")
    tag, n_ch, rate, _, align, bits = struct.unpack_from("<HHIIHH", raw, off)
    extensible = tag == WAVE_FORMAT_EXTENSIBLE
    if extensible:
        if size < 40:
            raise WeldDataError(f"{path}: WAVE_FORMAT_EXTENSIBLE fmt chunk is {size} bytes, need 40")
        valid_bits = struct.unpack_from("<H", raw, off + 18)[0]
        guid = raw[off + 24 : off + 40]
        if guid[2:] != _GUID_TAIL:
            raise WeldDataError(f"{path}: unknown WAVE_FORMAT_EXTENSIBLE subformat {guid.hex()}")
        tag = struct.unpack_from("<H", guid)[0]
        if valid_bits not in (0, bits):
            raise WeldDataError(
                f"{path}: {valid_bits} valid bits in {bits}-bit containers is not supported; "
                "export with matching container size"
            )
    if tag not in (WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT):
        raise WeldDataError(
            f"{path}: WAV format tag 0x{tag:04x} is not supported; export PCM (int16/int24/int32) "
            "or IEEE float (float32/float64)"
        )
    ok_bits = (8, 16, 24, 32) if tag == WAVE_FORMAT_PCM else (32, 64)
    if bits not in ok_bits or n_ch < 1 or rate < 1 or align != n_ch * bits // 8:
        raise WeldDataError(
            f"{path}: inconsistent WAV header (channels={n_ch}, rate={rate}, bits={bits}, "
            f"block_align={align}); supported bit depths for this format: {ok_bits}"
        )
    data_off, data_size = chunks[b"data"]
    if data_size != 0xFFFFFFFF:  # a header promising more than the cap is refused, not waited for
        try:
            check_size(path, data_size, max_bytes, what="its header declares", setting="max_file_bytes")
        except FileRefusedError as exc:
            raise WeldDataError(str(exc)) from None
    available = len(raw) - data_off
    if data_size in (0, 0xFFFFFFFF) or data_size > available:
        raise IncompleteWeldFileError(
            f"{path}: data chunk declares {data_size} bytes but {available} are present"
        )
    if data_size % align:
        raise WeldDataError(f"{path}: data chunk of {data_size} bytes is not a whole number of frames")
    info = WavInfo(tag, n_ch, rate, bits, data_size // align, extensible)
    return info, data_off, data_size


def read_wav(path: str | Path, *, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> tuple[np.ndarray, WavInfo]:
    """Read a WAV file into ``(samples (n_channels, n_frames) float64, info)``.

    Integer PCM is scaled to full-scale units; plain PCM is decoded by :mod:`wave`.  A link, a
    file over ``max_bytes`` or a header declaring more is refused before anything is decoded.
    """
    path = Path(path)
    whole = _read(path, max_bytes)
    info, data_off, data_size = _parse(whole, path, max_bytes)
    if info.format_tag == WAVE_FORMAT_PCM and not info.extensible:
        try:
            with wave.open(io.BytesIO(whole), "rb") as w:
                raw = w.readframes(w.getnframes())
        except (wave.Error, EOFError) as exc:
            raise WeldDataError(f"{path}: {exc}") from exc
        if len(raw) != data_size:
            raise IncompleteWeldFileError(f"{path}: wave read {len(raw)} of {data_size} data bytes")
    else:
        raw = whole[data_off : data_off + data_size]
    frames = _decode(raw, info).reshape(info.n_frames, info.n_channels)
    return np.ascontiguousarray(frames.T), info


def _decode(raw: bytes, info: WavInfo) -> np.ndarray:
    bits = info.bits_per_sample
    if info.format_tag == WAVE_FORMAT_IEEE_FLOAT:
        return np.frombuffer(raw, dtype="<f4" if bits == 32 else "<f8").astype(np.float64)
    if bits == 8:  # 8-bit WAV is unsigned with 128 as zero
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    if bits == 24:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend
        return ints.astype(np.float64) / float(1 << 23)
    ints = np.frombuffer(raw, dtype="<i2" if bits == 16 else "<i4")
    return ints.astype(np.float64) / float(1 << (bits - 1))


def write_wav(
    path: str | Path,
    samples: np.ndarray,
    sample_rate: int,
    *,
    sample_format: str = "int16",
    extensible: bool = False,
) -> None:
    """Write ``samples`` (n_channels, n_frames) to a WAV file.

    Parameters
    ----------
    samples
        Full-scale units for integer formats (values must lie in [-1, 1]); any
        finite values for float formats.
    sample_rate
        Integer samples per second.
    sample_format
        One of :data:`SAMPLE_FORMATS`.
    extensible
        Write a ``WAVE_FORMAT_EXTENSIBLE`` header (what most tools write for more than
        two channels); plain PCM without it goes through :mod:`wave`.
    """
    if sample_format not in SAMPLE_FORMATS:
        raise ValueError(f"sample_format {sample_format!r} not in {SAMPLE_FORMATS}")
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"samples must be shaped (n_channels, n_frames); got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("samples contain NaN or inf")
    frames = np.ascontiguousarray(x.T)
    tag, bits, payload = _encode(frames, sample_format, x)
    n_ch = x.shape[0]
    if tag == WAVE_FORMAT_PCM and not extensible:
        with wave.open(str(path), "wb") as w:
            w.setnchannels(n_ch)
            w.setsampwidth(bits // 8)
            w.setframerate(int(sample_rate))
            w.writeframes(payload)
        return
    fmt = _fmt_chunk(tag, n_ch, int(sample_rate), bits, extensible)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if tag != WAVE_FORMAT_PCM:  # the spec requires a fact chunk for non-PCM data
        body += b"fact" + struct.pack("<II", 4, frames.shape[0])
    body += b"data" + struct.pack("<I", len(payload)) + payload + (b"\x00" if len(payload) & 1 else b"")
    Path(path).write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def _encode(frames: np.ndarray, sample_format: str, x: np.ndarray) -> tuple[int, int, bytes]:
    """``(format tag, bits per sample, sample bytes)`` of ``frames`` (n_frames, n_channels)."""
    if sample_format.startswith("float"):
        bits = int(sample_format[5:])
        return WAVE_FORMAT_IEEE_FLOAT, bits, frames.astype("<f4" if bits == 32 else "<f8").tobytes()
    bits = int(sample_format[3:])
    if np.abs(x).max() > 1.0:
        raise ValueError(
            f"{sample_format} WAV needs full-scale samples in [-1, 1]; got max |x| = "
            f"{np.abs(x).max():.4g} (scale the data, or use a float format)"
        )
    full = 1 << (bits - 1)  # same scale as reading, so a round trip is within half an LSB
    ints = np.clip(np.round(frames * full), -full, full - 1).astype(np.int64)
    if bits == 24:
        return WAVE_FORMAT_PCM, bits, ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    return WAVE_FORMAT_PCM, bits, ints.astype("<i2" if bits == 16 else "<i4").tobytes()


def _fmt_chunk(tag: int, n_ch: int, rate: int, bits: int, extensible: bool) -> bytes:
    """The ``fmt `` chunk's body: plain (with an empty extension) or ``WAVE_FORMAT_EXTENSIBLE``."""
    align = n_ch * bits // 8
    if not extensible:
        return struct.pack("<HHIIHHH", tag, n_ch, rate, rate * align, align, bits, 0)
    mask = (1 << n_ch) - 1 if n_ch <= 18 else 0
    guid = struct.pack("<H", tag) + _GUID_TAIL
    return (
        struct.pack(
            "<HHIIHHHHI", WAVE_FORMAT_EXTENSIBLE, n_ch, rate, rate * align, align, bits, 22, bits, mask
        )
        + guid
    )

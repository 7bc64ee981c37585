"""Weld recordings and the WAV/NPY/CSV files they are exported as."""

from __future__ import annotations

import json
import pickle
import struct
from datetime import UTC, datetime, timedelta, timezone

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sensors.welding import (
    IncompleteWeldFileError,
    WeldDataError,
    WeldRecording,
    read_weld_file,
    write_weld_file,
)
from sensors.welding.wavfile import SAMPLE_FORMATS, read_wav, read_wav_info, write_wav
from tests.budget import examples

CH = ("power", "lvdt", "ae", "mic")
T0 = datetime(2024, 5, 1, 8, 30, tzinfo=UTC)


def make_recording(n: int = 4000, seed: int = 0, **kw) -> WeldRecording:
    rng = np.random.default_rng(seed)
    data = rng.normal(size=(4, n)) * np.array([[3000.0], [0.1], [0.5], [0.2]]) + np.array(
        [[1500.0], [0.05], [0], [0]]
    )
    return WeldRecording(data, CH, 200_000, kw.pop("weld_id", "W1"), kw.pop("started_at", T0), **kw)


# -- the recording type ------------------------------------------------------------------


def test_recording_validates_and_freezes():
    rec = make_recording()
    assert rec.data.dtype == np.float64 and not rec.data.flags.writeable
    assert rec.duration == pytest.approx(4000 / 200_000)
    assert rec.ended_at - rec.started_at == timedelta(seconds=0.02)
    np.testing.assert_array_equal(rec.select(("mic", "power")), rec.data[[3, 0]])
    with pytest.raises(KeyError, match="has power, lvdt, ae, mic"):
        rec.channel("temperature")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data": np.zeros((3, 100))}, "3 channel row"),
        ({"data": np.zeros(100)}, "must be 2-D"),
        ({"data": np.array([[0.0, np.nan]] * 4)}, "non-finite"),
        ({"sample_rate": 48_000}, "below the required 200000"),
        ({"sample_rate": -1}, "positive finite"),
        ({"weld_id": "bad id/.."}, "invalid weld_id"),
        ({"started_at": datetime(2024, 1, 1)}, "timezone-aware"),
        ({"channels": ("power", "power", "ae", "mic")}, "duplicate"),
        ({"channels": ("Power", "lvdt", "ae", "mic")}, "invalid channel name"),
    ],
)
def test_recording_rejects_bad_input_with_clear_errors(change, message):
    args = {
        "data": np.zeros((4, 100)),
        "channels": CH,
        "sample_rate": 200_000,
        "weld_id": "W1",
        "started_at": T0,
    }
    args.update(change)
    with pytest.raises(WeldDataError, match=message):
        WeldRecording(**args)


def test_recording_pickles_for_worker_processes():
    rec = make_recording(meta={"material": "Al-Cu"})
    back = pickle.loads(pickle.dumps(rec))
    np.testing.assert_array_equal(back.data, rec.data)
    assert not back.data.flags.writeable and back.meta == {"material": "Al-Cu"} and back.started_at == T0


def test_started_at_is_normalised_to_utc():
    rec = make_recording(started_at=datetime(2024, 5, 1, 10, 30, tzinfo=timezone(timedelta(hours=2))))
    assert rec.started_at == T0 and rec.started_at.tzinfo == UTC


# -- WAV ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", SAMPLE_FORMATS)
@pytest.mark.parametrize("extensible", [False, True])
def test_wav_round_trip_every_format(tmp_path, fmt, extensible):
    x = np.random.default_rng(1).uniform(-0.99, 0.99, size=(4, 999))
    path = tmp_path / "w.wav"
    write_wav(path, x, 200_000, sample_format=fmt, extensible=extensible)
    y, info = read_wav(path)
    assert (info.n_channels, info.sample_rate, info.n_frames, info.sample_format) == (4, 200_000, 999, fmt)
    assert info.extensible == extensible
    bits = {"int16": 16, "int24": 24, "int32": 32}.get(fmt)
    tol = 0.5 / 2 ** (bits - 1) + 1e-12 if bits else (6e-8 if fmt == "float32" else 0.0)
    assert np.abs(y - x).max() <= tol


def test_wav_from_an_independent_writer_matches(tmp_path):
    wavfile = pytest.importorskip("scipy.io.wavfile")
    x = np.random.default_rng(2).uniform(-1, 1, size=(1000, 4)).astype(np.float32)
    wavfile.write(tmp_path / "f.wav", 250_000, x)  # IEEE float, WAVE_FORMAT_IEEE_FLOAT
    ints = (x * 32767).astype(np.int16)
    wavfile.write(tmp_path / "i.wav", 250_000, ints)
    y, info = read_wav(tmp_path / "f.wav")
    assert info.sample_format == "float32" and info.sample_rate == 250_000
    np.testing.assert_array_equal(y, x.T.astype(np.float64))
    y, _ = read_wav(tmp_path / "i.wav")
    np.testing.assert_array_equal(y, ints.T / 32768.0)
    # and scipy reads what we write, EXTENSIBLE float included
    write_wav(tmp_path / "ours.wav", x.T, 250_000, sample_format="float32", extensible=True)
    rate, back = wavfile.read(tmp_path / "ours.wav")
    assert rate == 250_000
    np.testing.assert_array_equal(back, x)


def test_truncated_wav_is_incomplete_not_bad(tmp_path):
    path = tmp_path / "w.wav"
    write_wav(path, np.zeros((4, 1000)), 200_000)
    full = path.read_bytes()
    path.write_bytes(full[:-100])
    with pytest.raises(IncompleteWeldFileError, match="declares 8000 bytes but 7900"):
        read_wav_info(path)
    path.write_bytes(full[:30])
    with pytest.raises(IncompleteWeldFileError):
        read_wav(path)


def test_unsupported_wav_is_bad(tmp_path):
    path = tmp_path / "w.wav"
    write_wav(path, np.zeros((1, 10)), 200_000)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, 20, 0x0055)  # MPEG layer 3 tag
    path.write_bytes(bytes(raw))
    with pytest.raises(WeldDataError) as err:
        read_wav(path)
    assert all(noun in str(err.value) for noun in ("0x0055", "PCM")), err.value
    path.write_bytes(b"JUNK" + bytes(100))
    with pytest.raises(WeldDataError, match="not a RIFF/WAVE"):
        read_wav(path)


@settings(
    max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(2, 3000),
    n_ch=st.integers(1, 6),
    fmt=st.sampled_from(SAMPLE_FORMATS),
    extensible=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_wav_round_trip_property(tmp_path, n, n_ch, fmt, extensible, seed):
    x = np.random.default_rng(seed).uniform(-1, 1, size=(n_ch, n))
    path = tmp_path / "p.wav"
    write_wav(path, x, 192_000, sample_format=fmt, extensible=extensible)
    y, info = read_wav(path)
    assert y.shape == x.shape and info.sample_rate == 192_000
    assert np.abs(y - x).max() <= (2.0**-15 if fmt == "int16" else 2.0**-23)


# -- weld files with sidecars -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fmt", "rtol"),
    [
        ("a.wav", "int16", 2e-5),
        ("b.wav", "int32", 1e-9),
        ("c.wav", "float32", 1e-7),
        ("d.npy", "float64", 0.0),
        ("e.csv", "float64", 1e-8),
    ],
)
def test_weld_file_round_trip(tmp_path, name, fmt, rtol):
    rec = make_recording(meta={"material": "Cu-Cu"})
    back = read_weld_file(write_weld_file(rec, tmp_path / name, sample_format=fmt))
    assert back.channels == CH and back.sample_rate == 200_000 and back.weld_id == "W1"
    assert back.started_at == T0 and back.meta["material"] == "Cu-Cu"
    scale = np.abs(rec.data).max(axis=1, keepdims=True)
    assert np.abs(back.data - rec.data).max() <= rtol * scale.max() + 1e-12


def test_npy_accepts_samples_by_channels_and_refuses_ambiguity(tmp_path):
    data = np.random.default_rng(0).normal(size=(500, 4))
    np.save(tmp_path / "x.npy", data)
    (tmp_path / "x.json").write_text(json.dumps({"channels": list(CH), "sample_rate": 200000}))
    rec = read_weld_file(tmp_path / "x.npy")
    np.testing.assert_array_equal(rec.data, data.T)
    assert rec.weld_id == "x" and rec.meta["weld_id_source"] == "file name"
    np.save(tmp_path / "sq.npy", np.zeros((4, 4)))
    (tmp_path / "sq.json").write_text(json.dumps({"channels": list(CH), "sample_rate": 200000}))
    with pytest.raises(WeldDataError, match="unambiguously"):
        read_weld_file(tmp_path / "sq.npy")


def test_npy_needs_sidecar_and_detects_truncation(tmp_path):
    np.save(tmp_path / "y.npy", np.zeros((4, 1000)))
    with pytest.raises(WeldDataError, match=r"need a sidecar y.json with \['channels', 'sample_rate'\]"):
        read_weld_file(tmp_path / "y.npy")
    (tmp_path / "y.json").write_text(json.dumps({"channels": list(CH), "sample_rate": 200000}))
    raw = (tmp_path / "y.npy").read_bytes()
    (tmp_path / "y.npy").write_bytes(raw[:-8])
    with pytest.raises(IncompleteWeldFileError):
        read_weld_file(tmp_path / "y.npy")
    (tmp_path / "y.json").write_text('{"channels": ["power", ')
    with pytest.raises(IncompleteWeldFileError, match="JSON ends early"):
        read_weld_file(tmp_path / "y.npy")


def test_csv_rate_from_comment_sidecar_or_time_column(tmp_path):
    body = "\n".join(f"{i / 200000:.8f},{i},{-i},{i % 3},{i % 5}" for i in range(300)) + "\n"
    (tmp_path / "t.csv").write_text("time,Power,LVDT,AE,Mic\n" + body)
    rec = read_weld_file(tmp_path / "t.csv")
    assert rec.sample_rate == pytest.approx(200_000) and rec.channels == CH
    np.testing.assert_array_equal(rec.data[0], np.arange(300))
    (tmp_path / "u.csv").write_text("power,lvdt\n1,2\n3,4\n")
    with pytest.raises(WeldDataError, match="no sample rate; add a '# sample_rate: 200000' line"):
        read_weld_file(tmp_path / "u.csv")
    (tmp_path / "u.json").write_text(json.dumps({"sample_rate": 250000, "weld_id": "L20-7"}))
    rec = read_weld_file(tmp_path / "u.csv")
    assert rec.sample_rate == 250_000 and rec.weld_id == "L20-7"
    (tmp_path / "v.csv").write_text("# sample_rate: 200000\npower,lvdt\n1,2\n3,")
    with pytest.raises(IncompleteWeldFileError, match="no newline"):
        read_weld_file(tmp_path / "v.csv")
    # Between its header and its first row: waited for, as a file still being written (it was
    # refused for good, "1 columns of data but header has 2", beside a NumPy warning).
    (tmp_path / "h.csv").write_text("# sample_rate: 200000\npower,lvdt\n")
    with pytest.raises(IncompleteWeldFileError, match="a header and no rows yet"):
        read_weld_file(tmp_path / "h.csv")
    (tmp_path / "w.csv").write_text("# sample_rate: 200000\npower,lvdt\n1,2\n3,x\n")
    with pytest.raises(WeldDataError, match="unreadable CSV body"):
        read_weld_file(tmp_path / "w.csv")


def test_wav_without_sidecar_uses_default_channel_order_only_if_counts_match(tmp_path):
    write_wav(tmp_path / "m.wav", np.zeros((2, 100)), 200_000)
    with pytest.raises(WeldDataError, match=r'write m\.json with "channels"'):
        read_weld_file(tmp_path / "m.wav")
    rec = read_weld_file(tmp_path / "m.wav", default_channels=("ae", "mic"))
    assert rec.channels == ("ae", "mic")
    assert rec.meta["started_at_source"] == "file mtime minus duration"
    (tmp_path / "m.json").write_text(json.dumps({"sample_rate": 48000}))
    with pytest.raises(WeldDataError, match="disagrees with the WAV header"):
        read_weld_file(tmp_path / "m.wav", default_channels=("ae", "mic"))


def test_a_header_declaring_more_than_the_cap_is_refused_before_it_is_read(tmp_path):
    """A header's promise is checked against the cap before any sample is allocated (and is no
    "incomplete" file to wait for); the file's own size is checked before it is read."""
    cap = 1 << 20
    npy = tmp_path / "big.npy"
    header = {"descr": "<f8", "fortran_order": False, "shape": (4, 1 << 40)}  # 32 TiB declared
    with npy.open("wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * 64)
    npy.with_suffix(".json").write_text(json.dumps({"channels": ["a", "b", "c", "d"], "sample_rate": 2e5}))
    with pytest.raises(WeldDataError, match="its header declares 35184372088832 bytes, more than"):
        read_weld_file(npy, max_bytes=cap)
    wav = tmp_path / "big.wav"
    write_wav(wav, np.zeros((4, 1 << 17)), 200_000)  # 1 MiB of int16 data, 1 MiB + 44 on disk
    with pytest.raises(WeldDataError, match=r"big.wav: is 1048620 bytes, more than the 1048576"):
        read_weld_file(wav, max_bytes=cap)
    short = tmp_path / "short.wav"  # 4 KB on disk, a header promising 1 GiB: refused, not waited for
    short.write_bytes(wav.read_bytes()[:40] + struct.pack("<I", 1 << 30) + b"\0" * 4096)
    with pytest.raises(WeldDataError, match="its header declares 1073741824 bytes") as err:
        read_weld_file(short, max_bytes=cap)
    assert not isinstance(err.value, IncompleteWeldFileError)


def test_printable_keeps_a_name_on_one_line_and_escaping_twice_changes_nothing():
    from sensors.files import printable

    name = "bad\nFORGED ERROR\r\x1b[2J é\\x.csv"
    once = printable(name)
    assert "\n" not in once and "\r" not in once and "\x1b" not in once and "é" in once
    assert once == "bad\\nFORGED ERROR\\r\\x1b[2J é\\x.csv" and printable(once) == once

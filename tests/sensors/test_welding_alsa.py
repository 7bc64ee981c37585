"""Live capture: the energy segmenter, and ``arecord`` through a real ALSA PCM.

The ALSA test feeds a prepared raw file through alsa-lib's ``file`` PCM plugin
(slave ``null``) defined in a temporary config, so the bytes travel the real path:
alsa-lib -> ``arecord`` -> pipe -> :class:`AlsaWeldSource`.  It needs ``arecord``
(Debian package ``alsa-utils``); CI installs it, a laptop without it skips.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from sensors.welding import AlsaCaptureError, AlsaConfig, AlsaWeldSource, SourceConfigError
from sensors.welding.segment import EnergySegmenter, SegmenterConfig

FS = 200_000
ALSA_CONF = Path("/usr/share/alsa/alsa.conf")


def stream_with_welds(welds, total_s: float, n_ch: int = 2, seed: int = 0) -> np.ndarray:
    """Low noise with 20 kHz bursts at ``(start_s, duration_s)``."""
    rng = np.random.default_rng(seed)
    x = 0.003 * rng.standard_normal((n_ch, int(total_s * FS)))
    for start, dur in welds:
        a, b = int(start * FS), int((start + dur) * FS)
        x[:, a:b] += 0.5 * np.sin(2 * np.pi * 20_000 * np.arange(b - a) / FS)
    return x


def feed_in_blocks(seg: EnergySegmenter, x: np.ndarray, block: int):
    out = []
    for i in range(0, x.shape[1], block):
        out += seg.feed(x[:, i : i + block])
    return out + seg.flush()


@pytest.mark.parametrize("block", [7, 333, 4096, 10**6])
def test_segmenter_finds_welds_regardless_of_block_size(block):
    welds = [(0.05, 0.2), (0.4, 0.15), (0.7, 0.25)]
    x = stream_with_welds(welds, 1.05)
    if block == 7:
        x = x[:, :60_000]  # blocks smaller than a frame are slow to feed; the first weld suffices
        welds = welds[:1]
    segs = feed_in_blocks(EnergySegmenter(SegmenterConfig(FS)), x, block)
    assert len(segs) == len(welds)
    for seg, (start, dur) in zip(segs, welds, strict=True):
        assert abs(seg.start / FS - (start - 0.01)) <= 0.0011  # pre_s before, within a frame
        assert abs(seg.data.shape[1] / FS - (dur + 0.02)) <= 0.0021
        np.testing.assert_array_equal(seg.data, x[:, seg.start : seg.start + seg.data.shape[1]])
        assert not seg.truncated


def test_segmenter_drops_short_bursts_and_keeps_welds_that_dip():
    x = stream_with_welds([(0.1, 0.03), (0.3, 0.3)], 0.8)
    x[:, int(0.45 * FS) : int(0.47 * FS)] *= 0.01  # a 20 ms dip inside the weld: shorter than hangover
    segs = feed_in_blocks(EnergySegmenter(SegmenterConfig(FS)), x, 5000)
    assert len(segs) == 1 and abs(segs[0].start / FS - 0.29) < 0.002


def test_segmenter_cuts_at_max_length_and_at_end_of_stream():
    x = stream_with_welds([(0.05, 0.6), (0.8, 0.2)], 1.0)
    cfg = SegmenterConfig(FS, max_weld_s=0.3)
    segs = feed_in_blocks(EnergySegmenter(cfg), x, 8192)
    # the long weld is cut at 0.3 s, its remainder ignored (cooldown), the last one runs into EOF
    assert [s.truncated for s in segs] == [True, True]
    assert abs(segs[0].data.shape[1] / FS - 0.31) < 0.002
    assert abs(segs[1].start / FS - 0.79) < 0.002 and segs[1].start + segs[1].data.shape[1] == x.shape[1]


def test_segmenter_weld_at_stream_start_has_no_pre_samples():
    x = stream_with_welds([(0.0, 0.2)], 0.4)
    segs = feed_in_blocks(EnergySegmenter(SegmenterConfig(FS)), x, 4000)
    assert len(segs) == 1 and segs[0].start == 0


def test_segmenter_config_errors():
    with pytest.raises(ValueError, match="off_rms <= on_rms"):
        EnergySegmenter(SegmenterConfig(FS, on_rms=0.01, off_rms=0.1))
    with pytest.raises(SourceConfigError) as err:
        AlsaConfig(channels=("mic", "mic"), sample_format="S24_3LE", trigger_channel="ae", sample_rate=48_000)
    for text in ("unique", "sample_format", "trigger_channel", "below min_sample_rate"):
        assert text in str(err.value)


def _need_arecord() -> str:
    binary = shutil.which("arecord")
    if binary is None or not ALSA_CONF.exists():
        msg = "arecord/alsa-lib not installed (apt-get install alsa-utils)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return binary


def file_pcm(tmp_path: Path, raw: Path) -> dict[str, str]:
    """An ALSA config defining PCM ``weldtest`` that captures from ``raw``."""
    conf = tmp_path / "asoundrc"
    conf.write_text(
        'pcm.weldtest {\n type file\n slave.pcm "null"\n file "/dev/null"\n'
        f' infile "{raw}"\n format "raw"\n}}\n'
    )
    return {"ALSA_CONFIG_PATH": f"{ALSA_CONF}:{conf}"}


@pytest.mark.parametrize(
    ("fmt", "dtype", "scale"), [("S16_LE", "<i2", 2**15), ("S32_LE", "<i4", 2**31), ("FLOAT_LE", "<f4", 1.0)]
)
def test_arecord_through_a_real_alsa_pcm(tmp_path, fmt, dtype, scale):
    _need_arecord()
    welds = [(0.1, 0.3), (0.6, 0.25), (1.0, 0.35)]
    x = stream_with_welds(welds, 1.5)
    pcm = x.astype(dtype) if dtype == "<f4" else np.clip(np.round(x * scale), -scale, scale - 1).astype(dtype)
    raw = tmp_path / "capture.raw"
    pcm.T.tofile(raw)  # interleaved frames, as the card delivers them
    cfg = AlsaConfig(
        device="weldtest",
        channels=("mic", "ae"),
        sample_format=fmt,
        sample_limit=pcm.shape[1],
        env=file_pcm(tmp_path, raw),
        read_frames=3000,
    )
    with AlsaWeldSource(cfg) as src:
        recs = list(src)
    assert len(recs) == 3
    expected = pcm.astype(np.float64) / scale
    for rec, (start, _) in zip(recs, welds, strict=True):
        k = rec.meta["stream_sample"]
        assert abs(k / FS - (start - 0.01)) <= 0.0011
        np.testing.assert_array_equal(rec.data, expected[:, k : k + rec.n_samples])
        assert rec.channels == ("mic", "ae") and rec.sample_rate == FS
    gaps = [(b.started_at - a.started_at).total_seconds() for a, b in itertools.pairwise(recs)]
    assert gaps == pytest.approx([0.5, 0.4], abs=2e-3)
    assert len({r.weld_id for r in recs}) == 3


def test_arecord_drop_trigger_channel(tmp_path):
    _need_arecord()
    x = stream_with_welds([(0.1, 0.2)], 0.5, n_ch=2)
    x[1] = np.random.default_rng(5).uniform(-0.01, 0.01, x.shape[1])  # the payload channel is quiet
    pcm = np.round(x * 32767).astype("<i2")
    raw = tmp_path / "t.raw"
    pcm.T.tofile(raw)
    cfg = AlsaConfig(
        device="weldtest",
        channels=("trigger", "ae"),
        trigger_channel="trigger",
        drop_trigger=True,
        sample_limit=pcm.shape[1],
        env=file_pcm(tmp_path, raw),
    )
    with AlsaWeldSource(cfg) as src:
        (rec,) = list(src)
    assert rec.channels == ("ae",)
    k = rec.meta["stream_sample"]
    np.testing.assert_array_equal(rec.data[0], pcm[1, k : k + rec.n_samples] / 32768)


def test_arecord_unknown_device_raises_with_its_message(tmp_path):
    _need_arecord()
    cfg = AlsaConfig(device="no_such_pcm", sample_limit=100, env=file_pcm(tmp_path, tmp_path / "none.raw"))
    with AlsaWeldSource(cfg) as src, pytest.raises(AlsaCaptureError, match="Unknown PCM no_such_pcm"):
        src.read()


def test_missing_arecord_binary_says_how_to_install():
    src = AlsaWeldSource(AlsaConfig(arecord="arecord-not-installed-here"))
    with pytest.raises(AlsaCaptureError, match="apt-get install alsa-utils"):
        src.setup()

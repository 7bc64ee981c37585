"""The watched export folder: completeness, bad files, restarts, duplicates, the ledger."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from sensors.welding import (
    FolderSourceConfig,
    SourceConfigError,
    WatchedFolderSource,
    WeldRecording,
    write_weld_file,
)
from sensors.welding.ledger import LedgerEntry, WeldLedger
from sensors.welding.wavfile import write_wav

CH = ("power", "lvdt", "ae", "mic")
T0 = datetime(2024, 5, 1, 8, 0, tzinfo=UTC)


class FakeClock:
    """A monotonic clock the test steps by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def weld(i: int, n: int = 2000) -> WeldRecording:
    data = np.random.default_rng(i).normal(size=(4, n))
    return WeldRecording(data, CH, 200_000, f"W{i:04d}", T0 + timedelta(seconds=30 * i))


def settle(src: WatchedFolderSource, clock: FakeClock) -> None:
    """Let the source see the folder, then let settle_s pass."""
    assert src.read() is None
    clock.now += 3


def source(folder, clock, **kw) -> WatchedFolderSource:
    src = WatchedFolderSource(FolderSourceConfig(folder, settle_s=2.0, **kw), clock=clock)
    src.setup()
    return src


def test_complete_files_are_delivered_once_stable_oldest_first(tmp_path):
    clock = FakeClock()
    for i, name in [(2, "b.npy"), (1, "a.wav"), (3, "c.csv")]:
        path = write_weld_file(weld(i), tmp_path / name)
        os.utime(path, ns=(i * 10**9, i * 10**9))  # export order by mtime
    with source(tmp_path, clock) as src:
        assert src.read() is None  # just seen: not yet stable
        clock.now += 2.5
        got = src.read_all()
    assert [r.weld_id for r in got] == ["W0001", "W0002", "W0003"]
    np.testing.assert_allclose(got[0].data, weld(1).data, rtol=1e-6, atol=1e-6)
    assert src.stats.delivered == 3


def test_growing_file_waits_until_it_stops_changing(tmp_path):
    clock = FakeClock()
    path = write_weld_file(weld(1), tmp_path / "g.npy", sample_format="float64")
    full = path.read_bytes()
    path.write_bytes(full[: len(full) // 2])
    with source(tmp_path, clock, incomplete_timeout_s=60) as src:
        clock.now += 5
        assert src.read() is None  # stable but truncated: waiting, not rejected
        assert not (tmp_path / "rejected" / "g.npy").exists()
        path.write_bytes(full)  # the writer finishes: size changes, settle starts again
        assert src.read() is None
        clock.now += 2.5
        rec = src.read()
    assert rec is not None and rec.weld_id == "W0001"


def test_a_csv_with_its_header_and_no_rows_yet_is_waited_for(tmp_path):
    """A CSV writer caught between its header and its first row (it was moved aside for good as
    "1 columns of data but header has 4")."""
    clock = FakeClock()
    path = write_weld_file(weld(1), tmp_path / "h.csv")
    full = path.read_text()
    head = "".join(full.splitlines(keepends=True)[:2])  # "# sample_rate: ...", then the channels
    assert head.endswith("power,lvdt,ae,mic\n")
    path.write_text(head)
    with source(tmp_path, clock, incomplete_timeout_s=60) as src:
        settle(src, clock)
        assert src.read() is None  # stable, a header only: waiting, not rejected
        assert src.stats.rejected == 0 and not (tmp_path / "rejected" / "h.csv").exists()
        path.write_text(full)
        assert src.read() is None
        clock.now += 2.5
        rec = src.read()
    assert rec is not None and rec.weld_id == "W0001"


def test_marker_makes_a_file_ready_at_once_and_require_marker_waits_for_it(tmp_path):
    clock = FakeClock()
    write_weld_file(weld(1), tmp_path / "m.wav")
    write_weld_file(weld(2), tmp_path / "n.wav")
    (tmp_path / "m.wav.done").touch()
    with source(tmp_path, clock, require_marker=True) as src:
        assert [r.weld_id for r in src.read_all()] == ["W0001"]
        clock.now += 100
        assert src.read() is None  # n.wav is stable but has no marker
        (tmp_path / "n.done").touch()
        assert src.read().weld_id == "W0002"


def test_bad_files_are_moved_aside_with_a_reason_and_never_crash(tmp_path):
    clock = FakeClock()
    (tmp_path / "junk.wav").write_bytes(b"this is not audio at all" * 10)
    write_wav(tmp_path / "slow.wav", np.zeros((4, 100)), 48_000)
    (tmp_path / "slow.json").write_text(json.dumps({"channels": list(CH)}))
    nan = np.zeros((4, 100))
    nan[2, 50] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    (tmp_path / "nan.json").write_text(json.dumps({"channels": list(CH), "sample_rate": 200000}))
    write_weld_file(weld(5), tmp_path / "good.npy")
    with source(tmp_path, clock) as src:
        settle(src, clock)
        got = src.read_all()
    assert [r.weld_id for r in got] == ["W0005"]
    rejected = tmp_path / "rejected"
    reasons = {p.name: json.loads(p.read_text())["reason"] for p in rejected.glob("*.reason.json")}
    assert "not a RIFF/WAVE" in reasons["junk.wav.reason.json"]
    assert "below the required 200000" in reasons["slow.wav.reason.json"]
    assert "non-finite" in reasons["nan.npy.reason.json"]
    assert (rejected / "slow.json").exists() and not (tmp_path / "slow.wav").exists()
    assert src.stats.rejected == 3


def test_stalled_truncated_file_is_rejected_after_the_timeout(tmp_path):
    clock = FakeClock()
    path = tmp_path / "stall.wav"
    write_wav(path, np.zeros((4, 1000)), 200_000)
    path.write_bytes(path.read_bytes()[:-64])
    with source(tmp_path, clock, incomplete_timeout_s=30) as src:
        settle(src, clock)
        assert src.read() is None and path.exists()
        clock.now += 40
        assert src.read() is None
    reason = json.loads((tmp_path / "rejected" / "stall.wav.reason.json").read_text())["reason"]
    assert reason.startswith("incomplete:")


def test_restart_never_delivers_a_weld_twice(tmp_path):
    clock = FakeClock()
    for i in range(3):
        write_weld_file(weld(i), tmp_path / f"w{i}.wav")
    with source(tmp_path, clock) as src:
        settle(src, clock)
        assert src.read().weld_id == "W0000"  # the daemon "crashes" after one weld
    with source(tmp_path, clock) as src:
        settle(src, clock)
        assert [r.weld_id for r in src.read_all()] == ["W0001", "W0002"]
    write_weld_file(weld(3), tmp_path / "w3.wav")
    with source(tmp_path, clock) as src:
        settle(src, clock)
        assert [r.weld_id for r in src.read_all()] == ["W0003"]
        assert len(src.ledger) == 4


def test_duplicates_by_content_and_by_weld_id_are_skipped(tmp_path):
    clock = FakeClock()
    write_weld_file(weld(1), tmp_path / "a.npy")
    with source(tmp_path, clock) as src:
        settle(src, clock)
        assert src.read().weld_id == "W0001"
        (tmp_path / "copy.npy").write_bytes((tmp_path / "a.npy").read_bytes())
        (tmp_path / "copy.json").write_text((tmp_path / "a.json").read_text())
        write_weld_file(weld(1), tmp_path / "again.csv")  # same weld id, other format
        settle(src, clock)
        assert src.read_all() == []
        assert src.stats.duplicates == 2


def test_reused_file_names_without_ids_get_unique_weld_ids(tmp_path):
    clock = FakeClock()
    ids = []
    with source(tmp_path, clock, on_done="keep") as src:
        for i in range(2):
            write_wav(tmp_path / "last_weld.wav", np.random.default_rng(i).uniform(-1, 1, (4, 500)), 200_000)
            os.utime(tmp_path / "last_weld.wav", ns=(i, i))
            clock.now += 3
            assert src.read() is None
            clock.now += 3
            ids.append(src.read().weld_id)
    assert ids[0] == "last_weld" and ids[1].startswith("last_weld-") and len(set(ids)) == 2


@pytest.mark.parametrize("policy", ["move", "delete"])
def test_on_done_policies(tmp_path, policy):
    clock = FakeClock()
    write_weld_file(weld(1), tmp_path / "a.npy")
    (tmp_path / "a.done").touch()
    with source(tmp_path, clock, on_done=policy) as src:
        assert src.read().weld_id == "W0001"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == []
    moved = sorted(p.name for p in (tmp_path / "processed").iterdir())
    assert moved == (["a.done", "a.json", "a.npy"] if policy == "move" else [])


def test_ledger_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = WeldLedger(path)
    ledger.record(LedgerEntry("a.wav", 10, 1, "d1", "delivered", "W1"))
    ledger.close()
    with path.open("a") as fh:
        fh.write('{"name": "b.wav", "size": 1')  # power cut mid-append
    ledger = WeldLedger(path)
    assert len(ledger) == 1 and ledger.by_weld_id("W1") is not None
    ledger.record(LedgerEntry("b.wav", 20, 2, "d2", "delivered", "W2"))
    ledger.close()
    again = WeldLedger(path)
    assert [e.weld_id for e in again] == ["W1", "W2"]
    assert path.read_text().count("\n") == 2
    again.close()


def test_ledger_compacts_and_caps(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = WeldLedger(path, max_entries=5)
    for i in range(8):
        ledger.record(LedgerEntry(f"{i}.wav", i, i, f"d{i}", "delivered", f"W{i}", at=time.time() + i))
    ledger.close()
    ledger = WeldLedger(path, max_entries=5)
    assert [e.weld_id for e in ledger] == ["W3", "W4", "W5", "W6", "W7"]
    ledger.close()


def test_config_errors_list_every_field(tmp_path):
    with pytest.raises(SourceConfigError) as err:
        FolderSourceConfig(tmp_path, settle_s=-1, on_done="archive", done_dir="../x", marker_suffix="done")
    text = str(err.value)
    for field in ("settle_s", "on_done", "done_dir", "marker_suffix"):
        assert field in text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        WatchedFolderSource(FolderSourceConfig(tmp_path / "missing")).setup()

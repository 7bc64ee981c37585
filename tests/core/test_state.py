"""Atomic state files: a kill at any instant leaves the old or the new copy, never a torn one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from edge.state import StateError, atomic_write_bytes, load_arrays, save_arrays


def test_save_load_round_trip_keeps_previous(tmp_path):
    path = tmp_path / "s.safetensors"
    save_arrays(path, {"a": np.arange(3.0)}, {"round": 1})
    save_arrays(path, {"a": np.arange(4.0)}, {"round": 2})
    arrays, meta = load_arrays(path)
    assert meta == {"round": 2} and arrays["a"].shape == (4,)
    assert (tmp_path / "s.safetensors.prev").exists()


def test_corrupt_file_falls_back_to_previous_copy(tmp_path):
    path = tmp_path / "s.safetensors"
    save_arrays(path, {"a": np.arange(3.0)}, {"round": 1})
    save_arrays(path, {"a": np.arange(4.0)}, {"round": 2})
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the tensor bytes: caught by the checksum
    path.write_bytes(bytes(data))
    _, meta = load_arrays(path)
    assert meta == {"round": 1}
    assert (tmp_path / "s.safetensors.corrupt").exists()


def test_no_good_copy_is_an_error_not_garbage(tmp_path):
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"torn")
    with pytest.raises(StateError):
        load_arrays(path)
    assert load_arrays(tmp_path / "missing") is None


WRITER = """
import sys, numpy as np
from edge.state import save_arrays
path = sys.argv[1]
i = 0
while True:
    i += 1
    save_arrays(path, {"w": np.full(200_000, float(i))}, {"i": i})
"""


def test_kill_during_writes_never_corrupts(tmp_path):
    path = tmp_path / "state.safetensors"
    for trial in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
        deadline = time.monotonic() + 20
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.01 + 0.037 * trial)  # somewhere inside a later write
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        arrays, meta = load_arrays(path)  # must verify, possibly from .prev
        assert np.all(arrays["w"] == float(meta["i"]))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) <= 8  # temp files of killed writes are harmless and never read


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "x.bin"
    atomic_write_bytes(path, b"a" * 10)
    atomic_write_bytes(path, b"b" * 3)
    assert path.read_bytes() == b"bbb"

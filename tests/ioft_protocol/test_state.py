"""Atomic state files: a kill at any instant leaves the old or the new copy, never a torn one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from edge.task_state import TaskState, load_task_state, save_task_state
from ioft_protocol.state import StateError, atomic_write_bytes, decode_arrays, load_arrays, save_arrays


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
from ioft_protocol.state import save_arrays
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


# -- the metadata is checksummed too, and a task state's keys are checked --------------------------
def _edit(path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new))


def test_edited_metadata_fails_verification_and_falls_back(tmp_path):
    path = tmp_path / "s.safetensors"
    save_arrays(path, {"a": np.arange(3.0)}, {"round": 1, "n_samples": 17})
    save_arrays(path, {"a": np.arange(3.0)}, {"round": 2, "n_samples": 17})
    _edit(path, b'\\"n_samples\\": 17', b'\\"n_samples\\": 97')  # tensors untouched
    _, meta = load_arrays(path)
    assert meta == {"round": 1, "n_samples": 17}
    assert (tmp_path / "s.safetensors.corrupt").exists()
    _edit(tmp_path / "s.safetensors.prev", b'\\"round\\": 1', b'\\"round\\": 7')  # now the only copy
    with pytest.raises(StateError):
        load_arrays(path)


def test_files_without_a_metadata_checksum_still_load(tmp_path):
    """Files of the older format (tensor checksum only) load: their tensors are still verified."""
    from safetensors.numpy import save as st_save

    from trainer_lite.params import param_hash

    arrays = {"a": np.arange(3.0)}
    old = st_save(arrays, metadata={"meta": json.dumps({"round": 4}), "sha256": param_hash(arrays)})
    path = tmp_path / "old.safetensors"
    path.write_bytes(old)
    loaded, meta = load_arrays(path)
    assert meta == {"round": 4} and np.array_equal(loaded["a"], arrays["a"])
    path.write_bytes(old.replace(b"\x00\x00\x00\x00\x00\x00\x00\x40", b"\x00\x00\x00\x00\x00\x00\x00\x41"))
    with pytest.raises(StateError):  # 2.0 -> 2.000...4 in the tensor bytes: caught as before
        load_arrays(path)


def test_metadata_that_is_not_an_object_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    save_arrays(path, {"a": np.arange(2.0)}, {"k": 1})
    from safetensors.numpy import save as st_save

    path.write_bytes(st_save({"a": np.arange(2.0)}, metadata={"meta": "[1]", "sha256": "x"}))
    with pytest.raises(ValueError, match="not an object"):
        decode_arrays(path.read_bytes())


def _task_state(round_: int) -> TaskState:
    return TaskState(
        spec_json='{"name": "speed"}',
        local={"w": np.full(3, float(round_))},
        answered=(round_, "train"),
        upload={"d": np.arange(2.0)},
        upload_meta={"n_samples": 17, "global_hash": "ab" * 32},
        metrics={"test_loss": 0.5},
    )


def test_task_state_with_edited_answered_round_falls_back_to_the_previous_copy(tmp_path):
    path = tmp_path / "local.safetensors"
    save_task_state(path, _task_state(4))
    save_task_state(path, _task_state(5))
    assert load_task_state(path).answered == (5, "train")
    _edit(path, b'\\"answered\\": [5,', b'\\"answered\\": [6,')
    state = load_task_state(path)
    assert state.answered == (4, "train") and state.local["w"][0] == 4.0
    assert (tmp_path / "local.safetensors.corrupt").exists()


@pytest.mark.parametrize(
    "meta",
    [
        {"answered": None, "upload_meta": {}, "metrics": {}},  # no spec: was KeyError
        {"spec": 5, "answered": None},
        {"spec": "{}", "answered": [5]},
        {"spec": "{}", "answered": "5,train"},
        {"spec": "{}", "answered": [True, "train"], "upload_meta": {"n_samples": 1, "global_hash": "x"}},
        {"spec": "{}", "answered": [5, "train"], "upload_meta": {}},  # publishing would KeyError
        {"spec": "{}", "answered": [5, "train"], "upload_meta": {"n_samples": "17", "global_hash": "x"}},
        {"spec": "{}", "answered": None, "upload_meta": [1]},
        {"spec": "{}", "answered": None, "metrics": {"loss": "low"}},
    ],
)
def test_task_state_with_missing_or_ill_typed_keys_is_a_state_error_or_falls_back(tmp_path, meta):
    """A checksummed file whose metadata is not a task state counts as corrupt, like a bad checksum."""
    path = tmp_path / "local.safetensors"
    save_arrays(path, {"local.w": np.zeros(3)}, meta)
    with pytest.raises(StateError):
        load_task_state(path)
    save_task_state(path, _task_state(3))
    save_arrays(path, {"local.w": np.zeros(3)}, meta)  # the good copy is now .prev
    assert load_task_state(path).answered == (3, "train")


def test_dataset_file_missing_an_array_falls_back_or_is_a_state_error(tmp_path):
    """load_dataset: a checksummed file without train_y (was KeyError) is corrupt like a bad checksum."""
    from edge.dataset import FILE, load_dataset, save_dataset
    from trainer_lite.data import Dataset

    d = Dataset(np.zeros((4, 2)), np.ones((4, 1)))
    save_arrays(
        tmp_path / FILE, {"train_x": np.zeros((4, 2)), "test_x": np.zeros((1, 2)), "test_y": np.ones((1, 1))}
    )
    with pytest.raises(StateError):
        load_dataset(tmp_path)
    save_dataset(tmp_path, d, d, {"source": "x"})
    save_arrays(
        tmp_path / FILE,
        {"train_x": np.zeros((4, 2)), "train_y": np.ones((3, 1)), "test_x": d.x, "test_y": d.y},
    )
    train, _, meta = load_dataset(tmp_path)  # rows disagree: the previous copy is used
    assert meta == {"source": "x"} and len(train.y) == 4

"""Hostile files on the device (issue 32 §6), on real processes: ``edge-recorder`` on a weld folder
holding them beside good welds, and ``edge-trainer predict`` given each.

The hostile files: a symbolic link to a file with secret content, a regular file with secret
content under a weld's suffix, a sparse WAV whose header declares 1 GiB (4 KB on disk), a file
name holding a newline and a forged log line, a directory and ``/dev/null``.  Each is one line,
no traceback and no byte of the secret; the recorder sets each aside and stores the good welds.
Both processes run with their address space capped at 2 GiB, as on a small Pi: before the size
cap, the sparse WAV was decoded into gigabytes and died with a ``MemoryError`` traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from edge.dataset import load_dataset
from edge.recording.base import STATUS_FILE
from tests.edge.test_recorder_welder import export_weld, write_labels

DEVICE = "welder2"
TOKEN = "TOPSECRET-42"
SECRET = f"{TOKEN}:$y$j9T$hash:19000:0:99999:7:::\ndaemon:{TOKEN}:19000:0:99999:7:::\n"
FORGED = "FORGED welder9 ERROR injected"
MEMORY_CAP = 2 << 30  # a small Pi; the sparse WAV decoded as int16 -> float64 wants 4 GiB
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OPENBLAS_NUM_THREADS": "1"}


def small_pi() -> None:
    """The child's address space capped, so a file decoded without a cap fails as on a Pi."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def sparse_wav(path: Path, data_bytes: int = 1 << 30) -> None:
    """A 4-channel int16 WAV whose header declares ``data_bytes``: a hole on disk, not data."""
    fmt = struct.pack("<HHIIHH", 1, 4, 200_000, 200_000 * 8, 8, 16)
    head = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", data_bytes)
    with path.open("wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(head) + data_bytes) + head)
        f.truncate(8 + len(head) + data_bytes)  # a hole: 1 GiB long, 4 KB on disk


def hostile_folder(folder: Path, secret: Path) -> dict[str, Path]:
    """The hostile files in ``folder`` (older than any good weld), by what they are."""
    files = {
        "sparse": folder / "sparse.wav",
        "secret": folder / "secret.csv",
        "newline": folder / f"bad\n{FORGED}.csv",
        "link": folder / "linked.csv",
    }
    sparse_wav(files["sparse"])
    files["secret"].write_text(SECRET)
    files["newline"].write_text("power,lvdt\nnot,numbers\n")
    files["link"].symlink_to(secret)
    old = time.time() - 3600  # oldest first: before the fix the sparse WAV blocked the others
    for path in files.values():
        if not path.is_symlink():
            path.with_name(path.name + ".done").touch()  # complete at once, as the good welds
        os.utime(path, (old, old), follow_symlinks=False)
    return files


def test_the_recorder_sets_each_hostile_file_aside_in_one_line_and_stores_the_good_welds(tmp_path):
    inbox, state = tmp_path / "export", tmp_path / "state"
    inbox.mkdir()
    secret = tmp_path / "shadow"
    secret.write_text(SECRET)
    files = hostile_folder(inbox, secret)
    good = [export_weld(inbox, i, "TC1") for i in range(3)]
    labels = tmp_path / "maintenance.jsonl"
    write_labels(labels, [{"weld_id": wid, "tool": "TC1"} for wid, _ in good])
    cfg = tmp_path / "welder2.toml"
    cfg.write_text(
        f'device = "{DEVICE}"\nstate_dir = "{state}"\n[sensors]\nkind = "welder"\n'
        f'weld_folder = "{inbox}"\nlabel_log = "{labels}"\ntarget = "tool_m"\ntest_fraction = 0.0\n'
        "poll_s = 0.2\nsettle_s = 0.2\nstatus_every_s = 0.5\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge.recording.cli", "--device", DEVICE, "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=small_pi,
    )
    folder: dict = {}
    try:
        deadline = time.monotonic() + 120  # a bound on a hang, not a measured time
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                folder = json.loads((state / STATUS_FILE).read_text())["folder"]
            if folder.get("delivered") == 3 and folder.get("rejected") == 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and TOKEN.lower() not in err.lower(), err
    assert (folder.get("delivered"), folder.get("rejected")) == (3, 3), err
    train, test, _ = load_dataset(state)
    assert len(train) + len(test) == 3  # the good welds went on past the hostile ones
    lines = err.splitlines()
    assert not [ln for ln in lines if ln.startswith(FORGED)], err  # the name's newline is escaped
    for name in ("sparse.wav", "secret.csv", "bad\\nFORGED", "linked.csv"):
        named = [ln for ln in lines if name in ln]
        assert len(named) == 1, (name, named, err)
    assert "a symbolic link" in next(ln for ln in lines if "linked.csv" in ln)
    rejected = inbox / "rejected"
    for key in ("sparse", "secret", "newline"):
        assert (rejected / files[key].name).exists(), key  # set aside, not retried
        reason = (rejected / f"{files[key].name}.reason.json").read_text()
        assert TOKEN.lower() not in reason.lower(), reason
    assert files["link"].is_symlink()  # never followed, never moved


def test_predict_names_what_each_hostile_input_is_in_one_line(tmp_path):
    toml = tmp_path / "device.toml"
    toml.write_text(f'device = "{DEVICE}"\nstate_dir = "{tmp_path / "state"}"\n')
    secret = tmp_path / "shadow"
    secret.write_text(SECRET)
    inputs: dict[str, str] = {}  # path -> what the line must say
    for suffix in (".jsonl", ".csv", ".wav"):
        link = tmp_path / f"link{suffix}"
        link.symlink_to(secret)
        inputs[str(link)] = "is a symbolic link"
    for suffix in (".jsonl", ".csv", ".wav", ".npy"):  # the secret copied: a regular, hostile file
        copy = tmp_path / f"copy{suffix}"
        copy.write_text(SECRET)
        inputs[str(copy)] = "copy"
    sparse_wav(tmp_path / "sparse.wav")
    inputs[str(tmp_path / "sparse.wav")] = "more than the"
    inputs[str(tmp_path)] = "is a directory"
    inputs["/dev/null"] = "is a character device"
    inputs[str(tmp_path / "missing.jsonl")] = "no such file"
    for path, says in inputs.items():
        done = subprocess.run(
            [sys.executable, "-m", "edge.cli", "predict", "--config", str(toml), path],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
            preexec_fn=small_pi,
        )
        err = done.stderr
        assert done.returncode == 2, (path, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (path, err)
        assert TOKEN.lower() not in err.lower(), (path, err)
        assert says in err, (path, err)

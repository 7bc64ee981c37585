"""A swarm's task states are made durable together (``edge.group_commit``): one ``syncfs`` before
and one after the renames per turn instead of two fsyncs per device, the same bytes, each file old
or new after a kill, and nothing polled (sent) while a saved state waits for its commit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import edge.group_commit as group_commit
from edge.cli import config_from_args, parse_args
from edge.group_commit import GroupCommit
from edge.swarm import Swarm
from edge.task_state import TaskState, TaskStates, load_task_state, save_task_state, task_state_path
from ioft_protocol.state import load_arrays


def _state(i: int) -> TaskState:
    return TaskState(
        spec_json='{"name": "bench"}',
        local={"progress.rounds": np.full(1, float(i), np.float32)},
        answered=(i, "train"),
        upload={"v.value": np.full(1000, float(i), np.float32)},
        upload_meta={"n_samples": 45, "global_hash": "ab" * 32},
        metrics={"train_seconds": 0.001 * i},
    )


@pytest.fixture
def syncs(monkeypatch) -> dict[str, int]:
    """Counts of ``os.fsync`` and of the group commit's ``syncfs`` calls."""
    counts = {"fsync": 0, "syncfs": 0}
    fsync, syncfs = os.fsync, group_commit.syncfs

    def counted_fsync(fd: int) -> None:
        counts["fsync"] += 1
        fsync(fd)

    def counted_syncfs(fd: int) -> None:
        counts["syncfs"] += 1
        syncfs(fd)

    monkeypatch.setattr(os, "fsync", counted_fsync)
    monkeypatch.setattr(group_commit, "syncfs", counted_syncfs)
    return counts


def test_a_turn_of_many_devices_costs_two_syncfs_and_no_fsync(tmp_path, syncs):
    devices = [tmp_path / f"dev{i}" for i in range(5)]
    commit = GroupCommit()
    for d in devices:
        d.mkdir()
        commit.writer(d)
    for rnd in (1, 2):
        for d in devices:
            save_task_state(task_state_path(d, "bench"), _state(rnd), commit.write)
        assert commit.pending == 5 and syncs == {"fsync": 0, "syncfs": 2 * (rnd - 1)}
        commit.commit()
        assert commit.pending == 0 and syncs == {"fsync": 0, "syncfs": 2 * rnd}
    single = TaskStates(tmp_path / "single", "single", lambda: None)  # a real daemon: fsync'ed per save
    single.keep("bench", _state(1))
    assert syncs == {"fsync": 2, "syncfs": 4}  # the temp file and its folder
    for d in devices:  # the same bytes as the single daemon's path writes, the previous copy kept
        path = task_state_path(d, "bench")
        save_task_state(tmp_path / "ref.safetensors", _state(2))
        assert path.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
        assert load_task_state(path).answered == (2, "train")
        assert load_arrays(path.with_name(path.name + ".prev"))[1]["answered"] == [1, "train"]


def test_a_file_written_twice_in_one_turn_commits_the_first_copy_first(tmp_path):
    commit = GroupCommit()
    commit.writer(tmp_path)
    path = task_state_path(tmp_path, "bench")
    save_task_state(path, _state(1), commit.write)
    save_task_state(path, _state(2), commit.write)  # its temp file was in the batch: committed first
    assert load_task_state(path).answered == (1, "train") and commit.pending == 1
    commit.commit()
    assert load_task_state(path).answered == (2, "train")
    assert load_arrays(path.with_name(path.name + ".prev"))[1]["answered"] == [1, "train"]


def test_a_failed_commit_leaves_the_old_files_and_every_later_commit_fails(tmp_path, monkeypatch):
    commit = GroupCommit()
    commit.writer(tmp_path)
    path = task_state_path(tmp_path, "bench")
    save_task_state(path, _state(1))
    save_task_state(path, _state(2), commit.write)

    def broken(fd: int) -> None:
        raise OSError(5, "syncfs: Input/output error")

    monkeypatch.setattr(group_commit, "syncfs", broken)
    with pytest.raises(OSError):
        commit.commit()
    monkeypatch.undo()
    assert load_task_state(path).answered == (1, "train")  # not renamed: its bytes were never durable
    with pytest.raises(OSError, match="earlier group commit"):
        commit.commit()  # the uploads queued with the batch must never go out


WRITER = """
import sys
from pathlib import Path
import numpy as np
from edge.group_commit import GroupCommit
from edge.task_state import TaskState, save_task_state, task_state_path
root, n = Path(sys.argv[1]), int(sys.argv[2])
commit = GroupCommit()
folders = [root / f"dev{i}" for i in range(n)]
for d in folders:
    d.mkdir(exist_ok=True)
    commit.writer(d)
i = 0
while True:
    i += 1
    for d in folders:
        w = np.full(20_000, float(i), np.float32)
        state = TaskState('{"name": "bench"}', {"w": w}, (i, "train"), {"w": w}, {"n_samples": 1, "global_hash": "x"})
        save_task_state(task_state_path(d, "bench"), state, commit.write)
    commit.commit()
"""


def test_kill_during_group_commits_leaves_every_file_whole(tmp_path):
    n = 20
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(n)])
        last = task_state_path(tmp_path / f"dev{n - 1}", "bench")
        deadline = time.monotonic() + 30
        while not last.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.01 + 0.023 * trial)  # somewhere inside a later turn
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for i in range(n):
            state = load_task_state(task_state_path(tmp_path / f"dev{i}", "bench"))  # whole, maybe from .prev
            assert state is not None and np.all(state.local["w"] == float(state.answered[0]))


def _swarm(tmp_path, n: int) -> Swarm:
    conf = tmp_path / "device.toml"
    conf.write_text("keepalive = 60\n")
    argv = ["--device", "dev", "--fleet", "test", "--broker", "mqtt://127.0.0.1:9"]
    argv += ["--state-dir", str(tmp_path)]
    argv += ["--simulate", "printer", "--allow-plaintext", "--config", str(conf), "--log-level", "WARNING"]
    return Swarm(config_from_args(parse_args(argv)), n)


def test_the_swarm_commits_its_states_before_every_poll(tmp_path):
    swarm = _swarm(tmp_path, 2)
    assert all(t.states.write == swarm.commit.write for t in swarm.devices)
    waiting_at_poll: list[int] = []
    poll = swarm.loop.poll

    def watched(timeout: float):
        waiting_at_poll.append(swarm.commit.pending)
        return poll(timeout)

    swarm.loop.poll = watched
    turns = iter(range(3))

    def until() -> bool:  # a round answered by each device in this turn (as its handle does)
        turn = next(turns, None)
        if turn is None:
            return True
        for t in swarm.devices:
            t.states.keep("bench", _state(turn + 1))
        return False

    swarm.run(until)
    assert len(waiting_at_poll) >= 3 and set(waiting_at_poll) == {0}
    for t in swarm.devices:
        assert load_task_state(task_state_path(t.state_dir, "bench")).answered == (3, "train")

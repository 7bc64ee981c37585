"""``edge-trainer pause|resume``: the owner's opt-out file, and what the daemon's watch reads from it."""

from __future__ import annotations

import subprocess
import sys

from edge import optout
from edge.cli import main

TRAINER = (sys.executable, "-m", "edge.cli")


def test_pause_and_resume_by_the_device_toml(tmp_path, capsys):
    # Prepare: the device.toml names the state folder, as fleet init writes it
    state = tmp_path / "state"
    state.mkdir()
    toml = tmp_path / "device.toml"
    toml.write_text(f'device = "printer1"\nfleet = "f"\nbroker = "mqtt://x:1"\nstate_dir = "{state}"\n')
    watch = optout.PauseWatch(state)

    # Execute / Assert
    assert main(["pause", "--config", str(toml), "--note", "belt swap"]) == 0
    assert "paused" in capsys.readouterr().out
    assert watch.changed() and watch.reason == "paused by its owner: belt swap"
    assert not watch.changed()  # read again, nothing new
    assert main(["resume", "--config", str(toml)]) == 0
    assert watch.changed() and not watch.paused
    assert main(["resume", "--config", str(toml)]) == 0
    assert "not paused" in capsys.readouterr().out


def test_a_state_folder_that_is_not_there_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run(
        [*TRAINER, "pause", "--state-dir", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = subprocess.run([*TRAINER, "pause"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("edge-trainer: ") and "--config" in out.stderr


def test_a_paused_daemon_restarted_is_still_paused(tmp_path):
    optout.pause(tmp_path)
    assert optout.PauseWatch(tmp_path).reason == optout.REASON

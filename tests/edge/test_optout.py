"""``edge-trainer pause|resume``: the owner's opt-out file, and what the daemon's watch reads from it."""

from __future__ import annotations

from edge import optout
from edge.cli import main


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


def test_a_state_folder_that_is_not_there_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["pause", "--state-dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "does not exist" in err, err
    assert main(["pause"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edge-trainer: ") and "--config" in err and len(err.strip().splitlines()) == 1


def test_a_paused_daemon_restarted_is_still_paused(tmp_path):
    optout.pause(tmp_path)
    assert optout.PauseWatch(tmp_path).reason == optout.REASON

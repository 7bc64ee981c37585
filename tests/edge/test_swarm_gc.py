"""A swarm's long-lived objects are frozen out of the cyclic GC while it runs (``Swarm.run``)."""

from __future__ import annotations

import gc

from edge.cli import config_from_args, parse_args
from edge.swarm import Swarm


def test_swarm_freezes_its_objects_while_it_runs_and_lets_them_go_after(tmp_path):
    conf = tmp_path / "device.toml"
    conf.write_text("keepalive = 60\n")
    argv = [
        "--device",
        "dev",
        "--fleet",
        "test",
        "--broker",
        "mqtt://127.0.0.1:9",
        "--state-dir",
        str(tmp_path),
    ]
    argv += ["--simulate", "printer", "--allow-plaintext", "--config", str(conf), "--log-level", "WARNING"]
    swarm = Swarm(config_from_args(parse_args(argv)), 2)
    frozen_while_running = []

    def until() -> bool:
        frozen_while_running.append(gc.get_freeze_count())
        return True

    swarm.run(until)
    assert frozen_while_running and frozen_while_running[0] > 0
    assert gc.get_freeze_count() == 0

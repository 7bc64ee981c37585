"""Command-line flags win over the config file's fields, the same way in every command that reads one
(``serve``, the operator's commands, ``edge-trainer``): ``ioft_protocol.cli.flags_over_toml``."""

from __future__ import annotations

import argparse
from pathlib import Path

from cloud_aggregator.cli import _serve_config, build_parser
from cloud_aggregator.operator import add_session_args, operator_config
from edge.cli import config_from_args, parse_args
from ioft_protocol.cli import flags_over_toml

TOML = 'broker = "mqtt://file-host:1883"\nfleet = "from-file"\nstate_dir = "/var/from-file"\n'


def test_given_flags_replace_their_fields_and_absent_ones_leave_the_file_alone() -> None:
    raw = {"broker": "mqtt://file:1", "fleet": "f", "allow_plaintext": False, "restart": ["a"]}
    args = argparse.Namespace(broker="mqtt://flag:2", fleet=None, allow_plaintext=True, restart=("b", "c"))
    out = flags_over_toml(raw, args, "broker", "fleet", "allow_plaintext", "restart", "state_dir")
    assert out is raw
    assert raw == {"broker": "mqtt://flag:2", "fleet": "f", "allow_plaintext": True, "restart": ["b", "c"]}
    flags_over_toml(raw, argparse.Namespace(state_dir=Path("/srv/x"), restart=[]), "state_dir", "restart")
    assert raw["state_dir"] == "/srv/x" and raw["restart"] == ["b", "c"]  # a path as text; [] is no flag


def test_serve_the_operator_and_the_device_read_the_same_flags_over_the_same_file(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(TOML)
    flags = ["--config", str(toml), "--broker", "mqtt://127.0.0.1:1884", "--allow-plaintext"]

    serve = _serve_config(build_parser().parse_args(["serve", *flags]))
    session = argparse.ArgumentParser()
    add_session_args(session)
    operator = operator_config(session.parse_args([*flags, "--fleet", "from-flag"]), connects=False)
    device = config_from_args(parse_args(["--device", "printer1", *flags, "--fleet", "from-flag"]))

    for cfg in (serve, operator, device):
        assert (cfg.broker, cfg.allow_plaintext) == ("mqtt://127.0.0.1:1884", True)
    assert serve.fleet == "from-file" and serve.state_dir == "/var/from-file"  # no flag: the file's
    assert operator.fleet == device.fleet == "from-flag"

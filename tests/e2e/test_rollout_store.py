"""Where ``push --canary`` records its rollout.

``push --canary 1 --config operator.toml`` had no ``state_dir`` in the operator's TOML, so it
created ``/var/lib/ioft-aggregator/aggregator.sqlite`` (even for a push it then refused) and
recorded the rollout there, where neither ``serve`` nor the console looked.  Now fleet init's
operator.toml names the aggregator's state_dir, and no command creates a store: a missing or
wrong one is one line naming the file.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from cloud_aggregator.fleet.init import AGGREGATOR, OPERATOR, init_fleet
from cloud_aggregator.local.fleet import FLEET
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from ioft_protocol.config import load_toml

pytestmark = pytest.mark.broker


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cloud_aggregator.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_fleet_inits_operator_toml_names_the_aggregators_store(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", ["printer1"])
    assert load_toml(layout.toml(OPERATOR))["state_dir"] == load_toml(layout.toml(AGGREGATOR))["state_dir"]


def test_a_canary_push_or_rollout_status_without_the_store_says_so_and_creates_none(fleet_procs, tmp_path):
    priv, pub = generate_keypair(tmp_path / "keys" / "fleet.key")
    package = signed(window_encoder(tmp_path / "e.onnx"), tmp_path / "pkg", load_private_key(priv), version=1)
    state = tmp_path / "not-the-aggregators"
    config = tmp_path / "operator.toml"
    config.write_text(
        f'fleet = "{FLEET}"\nbroker = "{fleet_procs.broker_url}"\nallow_plaintext = true\nstate_dir = "{state}"\n'
    )
    out = run(
        "push", "--canary", "1", "--config", str(config), "--public-key", str(pub), str(package.manifest_path)
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"no aggregator store at {state / 'aggregator.sqlite'}" in out.stderr
    assert out.stderr.count("\n") == 1 and not state.exists()  # one line; nothing created

    out = run("rollout", "status", "--config", str(config))
    assert out.returncode == 2 and f"no aggregator store at {state / 'aggregator.sqlite'}" in out.stderr
    assert not state.exists()

    state.mkdir()
    (state / "aggregator.sqlite").write_text("not a database")
    out = run("rollout", "status", "--config", str(config))
    assert out.returncode == 2 and "is not an aggregator store" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1

"""``fleet init``'s systemd units pass ``systemd-analyze verify`` and say what the issue asks.

Each device folder carries ``ioft-edge-trainer@.service``, ``ioft-edge-recorder@.service``
and ``install.sh``; the fleet folder ``ioft-aggregator.service`` and a drop-in for Debian's
``mosquitto.service``.  ``systemd-analyze verify`` (Debian's ``systemd`` package; ``make
test`` installs it) loads them as systemd would and checks every directive and that each
``ExecStart`` is executable: the units name this checkout's venv, as ``--venv`` allows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_aggregator.fleet import devices as fleet_devices
from cloud_aggregator.fleet.init import init_fleet
from ioft_protocol.config import load_toml

DEVICES = ["printer1", "welder1"]
VENV = Path(sys.prefix)  # holds bin/edge-trainer, bin/edge-recorder, bin/cloud-aggregator
DEBIAN_MOSQUITTO = Path("/lib/systemd/system/mosquitto.service")


def _need(path: str | None, what: str) -> str:
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing; make test-deps installs it")
        pytest.skip(f"{what} is missing (apt-get install systemd mosquitto); make test installs it")
    return path


def directives(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit (every value of a repeated key, in order)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("units") / "fleet"
    init_fleet(root, "plant-a", DEVICES, venv=VENV)
    return root


def test_generated_units_pass_systemd_analyze_verify(fleet, tmp_path):
    # Prepare: the units as they would sit in /etc/systemd/system, beside Debian's mosquitto.service
    analyze = _need(shutil.which("systemd-analyze"), "systemd-analyze (Debian's systemd package)")
    _need(str(DEBIAN_MOSQUITTO) if DEBIAN_MOSQUITTO.exists() else None, str(DEBIAN_MOSQUITTO))
    units = tmp_path / "system"
    shutil.copytree(fleet / "systemd", units)
    for d in DEVICES:
        for unit in (fleet / "devices" / d / "systemd").iterdir():
            shutil.copy(unit, units)
    shutil.copy(DEBIAN_MOSQUITTO, units)
    names = [f"ioft-edge-{what}@{d}.service" for d in DEVICES for what in ("trainer", "recorder")]

    # Execute
    out = subprocess.run(
        [analyze, "verify", *names, "ioft-aggregator.service", "mosquitto.service"],
        cwd=units,
        capture_output=True,
        text=True,
    )

    # Assert: no error and no warning (a directive systemd does not take is only a warning)
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr


def test_each_unit_runs_as_its_own_user_sandboxed_with_a_watchdog(fleet):
    agg_toml = load_toml(fleet / "aggregator" / "aggregator.toml")
    for d in DEVICES:
        state_dir = load_toml(fleet / "devices" / d / "device.toml")["state_dir"]
        for what in ("trainer", "recorder"):
            u = directives((fleet / "devices" / d / "systemd" / f"ioft-edge-{what}@.service").read_text())
            assert u["ExecStart"] == [f"{VENV}/bin/edge-{what} --device %i --config /etc/ioft/%i/device.toml"]
            assert u["ReadWritePaths"][0].replace("%i", d) == state_dir  # the folder device.toml names
            assert u["StateDirectory"] == ["ioft/%i"] and u["User"] == ["ioft"]
            assert ("SupplementaryGroups" in u) == (what == "recorder")  # i2c for the recorder only
    agg = directives((fleet / "systemd" / "ioft-aggregator.service").read_text())
    assert agg["ReadWritePaths"] == [agg_toml["state_dir"]] and agg["User"] == ["ioft-aggregator"]
    assert agg["ExecStart"] == [
        f"{VENV}/bin/cloud-aggregator serve --service --config {fleet}/aggregator/aggregator.toml"
    ]
    recorder = directives(
        (fleet / "devices" / "printer1" / "systemd" / "ioft-edge-recorder@.service").read_text()
    )
    assert recorder["SupplementaryGroups"] == ["i2c"] and recorder["DeviceAllow"] == ["char-i2c rw"]
    for u in (agg, recorder):
        assert u["Type"] == ["notify"] and u["Restart"] == ["on-failure"] and int(u["WatchdogSec"][0]) > 0
        assert u["ProtectSystem"] == ["strict"] and u["NoNewPrivileges"] == ["yes"]
        assert u["CapabilityBoundingSet"] == [""]
    dropin = directives((fleet / "systemd" / "mosquitto.service.d" / "ioft.conf").read_text())
    assert dropin["ExecStart"] == ["", f"/usr/sbin/mosquitto -c {fleet}/broker/mosquitto.conf"]


def test_install_script_is_valid_sh_and_a_new_device_gets_units_too(fleet, tmp_path):
    for d in DEVICES:
        script = fleet / "devices" / d / "install.sh"
        assert os.access(script, os.X_OK)
        assert subprocess.run(["sh", "-n", str(script)], capture_output=True).returncode == 0
    copy = shutil.copytree(fleet, tmp_path / "fleet")
    fleet_devices.add_devices(copy, ["printer9"])
    new = copy / "devices" / "printer9" / "systemd" / "ioft-edge-trainer@.service"
    assert f"ExecStart={VENV}/bin/edge-trainer " in new.read_text()  # the venv fleet init was given
    assert (copy / "devices" / "printer9" / "install.sh").exists()

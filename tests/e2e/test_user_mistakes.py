"""Each console script answers an operator's mistake with one line saying what to fix, and exit 2:
the real scripts, run as processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "edge-trainer": "edge.cli",
    "edge-recorder": "edge.recording.cli",
    "cloud-aggregator": "cloud_aggregator.cli",
}


def run(script: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``script argv`` as a process (``python -m`` its module, as the console script calls ``main``)."""
    return subprocess.run(
        [sys.executable, "-m", SCRIPTS[script], *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def assert_mistake(out: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, no traceback, and one line on stderr naming each of ``needles``."""
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_serve_with_a_missing_config_file(tmp_path):
    assert_mistake(
        run("cloud-aggregator", "serve", "--config", "missing.toml", cwd=tmp_path),
        "missing.toml",
        "file not found",
    )


def test_serve_with_invalid_toml(tmp_path):
    (tmp_path / "aggregator.toml").write_text('broker = "mqtt://127.0.0.1:1883\n[[task]\n')
    out = run("cloud-aggregator", "serve", "--config", "aggregator.toml", cwd=tmp_path)
    assert_mistake(out, "aggregator.toml", "not valid TOML")


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:1883", "127.0.0.1:1883"])
def test_a_broker_url_without_mqtt_scheme(tmp_path, url):
    argv = ["--device", "printer3", "--broker", url, "--allow-plaintext", "--state-dir", str(tmp_path / "s")]
    assert_mistake(run("edge-trainer", *argv, "--simulate", "printer", cwd=tmp_path), "mqtt://host:port", url)


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:1883", "127.0.0.1:1883"])
def test_serve_with_a_broker_url_without_mqtt_scheme(tmp_path, url):
    argv = ["serve", "--broker", url, "--allow-plaintext", "--state-dir", str(tmp_path / "agg"), "--service"]
    assert_mistake(run("cloud-aggregator", *argv, cwd=tmp_path), "mqtt://host:port", url)
    assert not (tmp_path / "agg").exists()  # refused before anything is written


def test_serve_with_a_plaintext_url_while_tls_is_configured(tmp_path):
    (tmp_path / "aggregator.toml").write_text('broker = "mqtt://127.0.0.1:8883"\n[tls]\nca_file = "ca.pem"\n')
    out = run("cloud-aggregator", "serve", "--config", "aggregator.toml", "--service", cwd=tmp_path)
    assert_mistake(out, "TLS is configured", "mqtts://127.0.0.1")


def test_a_plaintext_url_while_tls_is_configured(tmp_path):
    (tmp_path / "device.toml").write_text('[tls]\nca_file = "ca.pem"\n')
    argv = ["--device", "printer3", "--config", "device.toml", "--broker", "mqtt://127.0.0.1:8883"]
    out = run("edge-trainer", *argv, "--state-dir", str(tmp_path / "s"), cwd=tmp_path)
    assert_mistake(out, "TLS is configured", "mqtts://127.0.0.1")


def test_an_unknown_model_name(tmp_path):
    (tmp_path / "aggregator.toml").write_text(
        f'broker = "mqtt://127.0.0.1:9"\nallow_plaintext = true\nstate_dir = "{tmp_path / "agg"}"\n'
        '[[task]]\nname = "vib"\nalgorithm = "fedavg"\nmodel = "printer_nnn"\n'
    )
    out = run("cloud-aggregator", "serve", "--config", "aggregator.toml", cwd=tmp_path)
    assert_mistake(out, "unknown model 'printer_nnn'", "printer_nn")
    assert not (tmp_path / "agg").exists() or not any((tmp_path / "agg").iterdir())


def test_the_readme_quickstart_without_a_config(tmp_path):
    # README: "`edge-trainer --device printer3` reads the machine's sensors" -- with no device.toml
    # the default broker is plaintext loopback, which a device refuses.
    out = run("edge-trainer", "--device", "printer3", "--state-dir", str(tmp_path / "s"), cwd=tmp_path)
    assert_mistake(out, "--config", "allow_plaintext")


def test_the_recorder_with_no_arguments(tmp_path):
    out = run("edge-recorder", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--simulate printer" in out.stderr.splitlines()[-1]

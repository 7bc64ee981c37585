"""Errors that name the file and say what to do: one line, a non-zero exit, no
traceback, from the real scripts run as processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_user_mistakes import run


def assert_one_line(out: subprocess.CompletedProcess, status: int, *needles: str) -> str:
    """Exit ``status``, no traceback, one line on stderr naming each of ``needles``; that line."""
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == status and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    """A fleet folder as ``fleet init`` writes it (its operator's TLS files are real)."""
    root = tmp_path_factory.mktemp("fleet") / "plant"
    out = run("cloud-aggregator", "fleet", "init", "--fleet", "plant", "--devices", "printer1", "--out", str(root),
              "--host", "127.0.0.1", "--port", "18883", cwd=root.parent)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return root


@contextlib.contextmanager
def tiny_disk(where: Path, size: str) -> Iterator[Path]:
    """A real full-disk: a ``size`` tmpfs mounted at ``where`` (root only)."""
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_names_the_weld_file_and_leaves_no_partial_one(tmp_path):
    with tiny_disk(tmp_path / "disk", "200k") as disk:
        out = run("edge-trainer", "--device", "welder1", "--simulate", "welder", "--state-dir", str(disk / "w"),
                  "--broker", "mqtt://127.0.0.1:9", "--allow-plaintext", cwd=tmp_path)  # fmt: skip
        inbox = disk / "w" / "weld-inbox"
        line = assert_one_line(out, 1, f"cannot write {inbox / 'welder1-00000.npy'}", "free space")
        assert list(inbox.iterdir()) == [], line  # the partial weld is gone


def test_fleet_init_into_a_folder_that_takes_no_files(tmp_path):
    out = run("cloud-aggregator", "fleet", "init", "--fleet", "plant", "--devices", "printer1",
              "--out", "/proc/fleetx", cwd=tmp_path)  # fmt: skip
    assert_one_line(out, 2, "/proc/fleetx", "--out")


@pytest.mark.parametrize("missing", ["ca_file", "key_file"])
def test_a_missing_tls_file_is_named(fleet, tmp_path, missing):
    toml = (fleet / "operator" / "operator.toml").read_text()
    was = {"ca_file": fleet / "ca" / "ca.crt", "key_file": fleet / "operator" / "operator.key"}[missing]
    gone = tmp_path / was.name
    (tmp_path / "operator.toml").write_text(toml.replace(f'"{was}"', f'"{gone}"'))
    out = run(
        "cloud-aggregator", "fleet", "status", "--config", str(tmp_path / "operator.toml"), cwd=tmp_path
    )
    line = assert_one_line(out, 1, f"{missing} {gone}", "No such file")
    other = "key_file" if missing == "ca_file" else "ca_file"
    assert other not in line  # the file that loads is not blamed


def test_a_corrupt_manifest_is_named(fleet, tmp_path):
    manifest = tmp_path / "encoder-v2.manifest.json"
    manifest.write_text('{"manifest": "{\\"name\\": \\"encoder\\"}", "signature": ')  # cut short
    (tmp_path / "encoder-v2.onnx").write_bytes(b"")
    out = run("cloud-aggregator", "push", str(manifest), "--config", str(fleet / "operator" / "operator.toml"),
              cwd=tmp_path)  # fmt: skip
    assert_one_line(out, 2, str(manifest), "export the model again")


def test_fleet_status_without_a_config_says_which_to_pass(tmp_path):
    assert_one_line(run("cloud-aggregator", "fleet", "status", cwd=tmp_path), 2, "--config operator.toml")

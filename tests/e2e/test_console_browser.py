"""The fleet console in a real browser: Debian's Chromium driven by Playwright, on a real fleet
(mosquitto, two ``edge-trainer --simulate printer`` processes, ``serve``, ``console``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.console_overhead import CHROMIUM_ARGS
from cloud_aggregator.local_fleet import aggregator_toml, pflda_task
from tests.e2e.watched import Watched

DEVICES = ["printer1", "printer2"]
CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]


def artifacts() -> Path:
    """Where screenshots go: ``$IOFT_ARTIFACTS``, else ``tests/artifacts`` (git ignores both)."""
    path = Path(os.environ.get("IOFT_ARTIFACTS") or ROOT / "tests" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _require_browser() -> None:
    missing = []
    if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
        missing.append("Debian's chromium (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing.append("playwright (pip install playwright; never `playwright install`)")
    if missing:
        msg = "the console test needs " + " and ".join(missing) + "; `make test-deps` installs chromium"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def browser_page() -> Iterator[object]:
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()


def _console(config: Path) -> tuple[Watched, str]:
    console = Watched(
        "cloud_aggregator.cli",
        ["console", "--config", str(config), "--port", "0", "--refresh", "0.2"],
    )
    console.wait_until(lambda: console.matching("console: http://"), 20, "the console's URL")
    return console, console.matching("console: http://")[0].split()[-1]


@pytest.mark.broker
def test_console_shows_devices_and_a_new_point_arrives_live(fleet_procs, browser_page):
    page = browser_page
    work = fleet_procs.work
    # Prepare: two printers and the console; no aggregator yet, so the page is open before round 1.
    fleet_procs.start_devices(DEVICES)
    config = work / "aggregator.toml"
    short = aggregator_toml(
        fleet_procs.broker_url, work / "aggregator", [pflda_task(rounds=3)], expected=DEVICES
    )
    config.write_text(short)
    console, url = _console(config)
    try:
        page.goto(url)
        # Execute + assert: the devices appear from their retained statuses, online.
        for d in DEVICES:
            page.wait_for_selector(f'#devices tr[data-device="{d}"][data-online="true"]', timeout=20_000)
        fleet_procs.start_aggregator(short)
        assert fleet_procs.wait_aggregator(60) == 0, fleet_procs.log("aggregator")
        mean = 'svg[data-task="speed"] path[data-series="fleet mean"]'
        page.wait_for_selector(f'{mean}[data-points="3"]', timeout=20_000)
        # The same task extended to 5 rounds: the open page gets the new points over SSE, no reload.
        fleet_procs.start_aggregator(
            aggregator_toml(
                fleet_procs.broker_url, work / "aggregator", [pflda_task(rounds=5)], expected=DEVICES
            )
        )
        page.wait_for_selector(f'{mean}[data-points="5"]', timeout=30_000)
        assert fleet_procs.wait_aggregator(60) == 0, fleet_procs.log("aggregator")
        for d in DEVICES:
            assert (
                page.locator(f'svg[data-task="speed"] path[data-series="{d}"]').get_attribute("data-points")
                == "5"
            )
        assert page.locator("#conn").inner_text() == "live"
        page.screenshot(path=str(artifacts() / "console.png"), full_page=True)
    finally:
        console.stop()
    assert console.proc.returncode == 0, console.text[-2000:]


def test_console_off_loopback_wants_a_token(tmp_path):
    """Bound to every address it makes up a token and prints it; without the token: 401."""
    cmd = [sys.executable, "-m", "cloud_aggregator.cli", "console", "--broker", "mqtt://127.0.0.1:9"]
    cmd += ["--allow-plaintext", "--state-dir", str(tmp_path), "--port", "0", "--host", "0.0.0.0"]
    console = Watched(cmd[2], cmd[3:])
    try:
        console.wait_until(lambda: console.matching("console: http://"), 20, "the console's URL")
        url = console.matching("console: http://")[0].split()[-1]
        assert "?token=" in url
        port = url.split(":")[2].split("/")[0]
        token = url.split("?token=")[1]
        with pytest.raises(urllib.request.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/view", timeout=5)
        assert refused.value.code == 401
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"}
        )
        assert b"ioft_devices_online 0.0" in urllib.request.urlopen(req, timeout=5).read()
    finally:
        console.stop()
    empty = subprocess.run([*cmd, "--token", " "], capture_output=True, text=True, timeout=30)
    assert empty.returncode == 2 and "--token" in empty.stderr and "Traceback" not in empty.stderr

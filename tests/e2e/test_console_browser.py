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

import numpy as np
import pytest

from benchmarks.console_overhead import CHROMIUM_ARGS
from cloud_aggregator.local.fleet import aggregator_toml, pflda_task
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
        page.click("#to-learning")  # the landing page is the machines view (test_console_machines)
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


SAT_OUT = "the task's model takes 6 input features per row, but the local data (welder) has 624"


def _newcomer_store(state_dir: Path) -> None:
    """What a newcomer's first fleet leaves: one printer trains (accuracy near 1), a welder sits
    every round out, and a restarted printer's re-sent uploads."""
    from cloud_aggregator.rounds.types import Reason, RoundRecord
    from cloud_aggregator.store.sqlite import SqliteStore

    store = SqliteStore(state_dir / "aggregator.sqlite")
    store.register_task("speed", '{"name": "speed", "algorithm": "fedavg", "model": "mlp", "rounds": 5}')
    for r in range(1, 5):
        acc = {"test_accuracy": 0.96 + 0.01 * r}
        rec = RoundRecord("speed", r, "train", "completed", ["printer1"], {"printer1": 45}, {"printer1": acc},
                          {}, "h", 100.0 * r, 100.0 * r + 1, {"closed": "answered", "refused": {"welder1": SAT_OUT}})  # fmt: skip
        store.save(rec, (r + 1, 0), {"w": np.zeros(2, np.float32)}, {})
    for _ in range(2):
        store.put_rejection("speed", 2, "printer1", Reason.RESENT, "a copy of the upload counted")
    store.put_rejection("speed", 3, "printer1", Reason.NORM, "too far")
    store.close()


@pytest.mark.broker
def test_console_as_a_newcomer_sees_it(mosquitto, browser_page, tmp_path):
    """Each refusal once, a sat-out reason once, no "round None", an accuracy axis within [0, 1],
    a lone device's curve above the fleet mean, re-sent uploads apart from refusals."""
    import json

    import paho.mqtt.client as paho

    from ioft_protocol import topics

    page = browser_page
    _newcomer_store(tmp_path / "agg")
    statuses = {
        "printer1": {"state": "online", "kind": "printer", "tasks": {"speed": {"round": 4, "metrics": {}}},
                     "serving": {"enabled": True, "models": {"speed": {"round": 4, "reference": None}}}},
        "welder1": {"state": "online", "kind": "welder", "tasks": {"tool": {"round": None, "metrics": {}}},
                    "refused": {"speed": SAT_OUT}},
    }  # fmt: skip
    pub = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
    pub.connect("127.0.0.1", mosquitto.port)
    pub.loop_start()
    for device, body in statuses.items():
        topic = topics.topic_status("plant", device)
        pub.publish(topic, json.dumps({"device": device, **body}), qos=1, retain=True).wait_for_publish(5)
    pub.disconnect()
    pub.loop_stop()
    config = tmp_path / "agg.toml"
    config.write_text(
        f'fleet = "plant"\nbroker = "{mosquitto.url}"\nstate_dir = "{tmp_path / "agg"}"\nallow_plaintext = true\n'
    )
    console, url = _console(config)
    try:
        page.goto(url)
        # A serving model with no test-split figure: nothing to tell drift from, and the card says so.
        page.wait_for_selector('.machine[data-device="printer1"] .no-reference', timeout=20_000)
        page.click("#to-learning")  # the landing page is the machines view (test_console_machines)
        page.wait_for_selector('#devices tr[data-device="welder1"]', timeout=20_000)
        page.wait_for_selector('svg[data-task="speed"] path[data-series="printer1"]', timeout=20_000)
        page.screenshot(path=str(artifacts() / "console_newcomer.png"), full_page=True)
        body = page.inner_text("body")
        welder = page.locator('#devices tr[data-device="welder1"] td')
        printer = page.locator('#devices tr[data-device="printer1"] td')
        # The welder's refusal once (its own column), the sat-out reason once (under the rounds).
        assert body.count(SAT_OUT) == 2, body  # the device's "tasks refused" cell and the rounds' note
        assert SAT_OUT not in welder.nth(7).inner_text() and SAT_OUT in welder.nth(8).inner_text()
        assert page.locator("ul.sat-out li").count() == 1
        assert [c.inner_text() for c in page.locator("tr[data-round] td:nth-child(7)").all()] == [
            "welder1"
        ] * 4
        assert "round None" not in body and "tool: no round yet" in welder.nth(7).inner_text()
        # Re-sent uploads: apart, not red; the norm refusal red.
        uploads = printer.nth(9)
        assert uploads.locator(".bad").inner_text() == "norm: 1"
        assert uploads.locator(".resent").inner_text() == "(resent: 2)"
        # An accuracy axis stays within [0, 1]; the lone device's curve is drawn above the mean.
        texts = page.locator('svg[data-task="speed"] text').evaluate_all("ts => ts.map(t => t.textContent)")
        labels = [float(t) for t in texts[:5]]  # the y axis's five labels come first
        assert max(labels) <= 1.0, labels
        order = page.locator('svg[data-task="speed"] path').evaluate_all(
            "ps => ps.map(p => p.dataset.series)"
        )
        assert order == ["fleet mean", "printer1"]
    finally:
        console.stop()

"""Watching the machines on real processes and a real mosquitto: a simulated welder's tool wears, the
trainer's alert rule raises one alert and clears it once a new tool is fitted, field accuracy moves
as the lagging maintenance log lands; a printer's speed advice reaches a (simulated) Moonraker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from cloud_aggregator.local.fleet import FLEET, Sniffer, pflda_task
from edge.serving.advice import velocity_script
from ioft_protocol import topics
from sensors.sim.printer_host import FakeMoonraker, short_timeline
from tests.e2e.retained import retained_status
from tests.e2e.test_serving import WELD_TASK, answers, record, train

WELDER_TOML = """
[serve]
field_window = 8
[[serve.alerts]]
name = "worn_tool"
task = "tool"
value = "p:TC4"
above = 0.6
k = 3
n = 4
clear_below = 0.4
action = "replace the horn"
[serve.classes]
TC4 = "worn horn and worn anvil"
"""


#: PFL-DA with enough steps in 3 rounds to expect real speeds on the recorder's printer (not ~0 mm/s).
ADVISING_TASK = pflda_task(rounds=3) | {"hparams": {"lr": 0.5, "weight_decay": 0.0, "local_steps": 200}}


def alert_events(sniffer: Sniffer, device: str, rule: str) -> list[dict]:
    topic = topics.topic_alert(FLEET, device, rule)
    return [json.loads(p) for t, p in list(sniffer.messages) if t == topic]


def serving_status(fleet, device: str) -> dict:
    return retained_status(fleet.broker_url, device).get("serving", {})


@pytest.mark.broker
def test_a_wearing_tool_raises_one_alert_and_a_new_tool_clears_it(fleet_procs):
    work, dev = fleet_procs.work, "w1"
    toml = work / "w1.toml"
    # A changed status (field scores, alerts) goes out at most every round_status_s (30 s by default,
    # to spare the aggregator a flood): 1 s lets the test wait for the change rather than the pace.
    toml.write_text("round_status_s = 1.0\n" + WELDER_TOML)
    # The dataset: 12 welds of a new tool (TC1), then 12 of a worn one (TC4), every one labelled.
    record(work, dev, "welder", "--welds", "24", "--weld-s", "0.05", "--wear-from", "12", "--wear-welds", "1")
    fleet_procs.start_device(dev, "--config", str(toml), "--log-level", "INFO", simulate=None)
    task = WELD_TASK | {"rounds": 4, "hparams": WELD_TASK["hparams"] | {"local_steps": 20}}
    train(fleet_procs, dev, task, 4)
    sniffer = Sniffer(fleet_procs.broker_url)
    try:
        # Worn from the first weld on; the log labels each weld one simulated hour (3 welds) late.
        record(work, dev, "welder", "--welds", "10", "--weld-s", "0.1", "--wear-from", "0",
               "--wear-welds", "1", "--label-lag-h", "1", "--sim-weld-min", "20")  # fmt: skip
        fleet_procs.wait_for(lambda: len(answers(sniffer, dev, "tool")) >= 10, 30, "an answer per weld")
        worn = [a["probabilities"][a["classes"].index("TC4")] for a in answers(sniffer, dev, "tool")]
        # A prediction set on every answer (all classes until calibrated) and whether its row is in range.
        for a in answers(sniffer, dev, "tool"):
            assert set(a["conformal"]["set"]) <= set(a["classes"]) and isinstance(a["in_range"], bool)
        fleet_procs.wait_for(
            lambda: alert_events(sniffer, dev, "worn_tool"), 30, f"the alert (P(TC4) answered: {worn})"
        )

        def accounted() -> bool:  # 7 labelled, and the status counts every one of the 10 answers
            field = serving_status(fleet_procs, dev).get("field", {}).get("tool", {})
            return (
                field.get("scored", 0) >= 7 and field.get("scored", 0) + field.get("awaiting_labels", 0) >= 10
            )

        fleet_procs.wait_for(accounted, 30, "the lagging labels scoring the answers")
        status = retained_status(fleet_procs.broker_url, dev)
        assert [a["rule"] for a in status["alerts"]] == ["worn_tool"]
        # `fleet status` lists the open alert with the operator's words.
        cmd = [sys.executable, "-m", "cloud_aggregator.cli", "fleet", "status", "--broker",
               fleet_procs.broker_url, "--fleet", FLEET, "--allow-plaintext"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert (
            "open alerts: 1\n  w1: worn_tool (task tool — worn horn and worn anvil) open since " in out.stdout
        )
        assert "what to do: replace the horn" in out.stdout, out.stdout + out.stderr
        field = status["serving"]["field"]["tool"]
        assert field["metric"] == "accuracy" and field["awaiting_labels"] >= 3  # the last 3 not labelled yet
        # A new tool: the answers fall back under clear_below, the alert clears once.
        record(work, dev, "welder", "--welds", "8", "--weld-s", "0.1", "--wear-from", "1000")
        fleet_procs.wait_for(
            lambda: len(alert_events(sniffer, dev, "worn_tool")) >= 2,
            30,
            f"the alert clearing (answers: {[a.get('predicted') for a in answers(sniffer, dev, 'tool')]})",
        )
        time.sleep(0.5)  # a flood would show here
    finally:
        sniffer.stop()
    events = alert_events(sniffer, dev, "worn_tool")
    assert [e["state"] for e in events] == ["raised", "cleared"]
    assert all(
        e["action"] == "replace the horn" and e["meaning"] == "worn horn and worn anvil" for e in events
    )
    assert events[0]["votes"] >= 3 and events[1]["since"] == events[0]["at"]
    fleet_procs.wait_for(
        lambda: retained_status(fleet_procs.broker_url, dev).get("alerts") == [], 30, "no open alert"
    )


@pytest.mark.broker
def test_moonraker_receives_the_advised_speed_at_the_start_of_a_print_and_gets_its_limit_back(fleet_procs):
    work, dev = fleet_procs.work, "p1"
    timeline, _ = short_timeline(time.monotonic(), layers=1, dur=1.0, job="x.gcode")
    # The stand-in keeps Klipper's limits (the recorder plays its own simulated Moonraker): printing.
    moonraker = FakeMoonraker(timeline, time.monotonic, max_velocity=300.0)
    moonraker.print_state = "printing"
    try:
        toml = work / "p1.toml"
        toml.write_text(
            # A model of a few rounds expects slow speeds: a floor of 0 lets the plumbing show (the
            # 5 mm/s floor has its unit test); 17,550 mm/s never reaches the printer whatever it is.
            # round_status_s: the status waited for below shows within ~1 s, not the 30 s pace.
            "round_status_s = 1.0\n"
            f'[serve]\nvibration_budget = 1.0\nmin_advice = 0.0\nmax_advice = 200.0\napply = "moonraker"\n'
            f'dry_run = false\nmoonraker_url = "{moonraker.url}"\n'
        )
        record(work, dev, "printer", "--layers", "6", "--layer-s", "0.3")
        fleet_procs.start_device(dev, "--config", str(toml), "--log-level", "INFO", simulate=None)
        train(fleet_procs, dev, ADVISING_TASK, 3)
        sniffer = Sniffer(fleet_procs.broker_url)
        try:
            # Enough layers for the interval to be calibrated (9 labelled residuals at 90 %) within the print.
            record(work, dev, "printer", "--layers", "12", "--layer-s", "0.3")
            fleet_procs.wait_for(lambda: len(answers(sniffer, dev, "speed")) >= 12, 30, "answers")
            fleet_procs.wait_for(lambda: moonraker.scripts, 30, "the advice at Moonraker")
        finally:
            sniffer.stop()
        for a in answers(sniffer, dev, "speed"):  # an interval on every answer, unbounded until calibrated
            c = a["conformal"]
            assert c["level"] == 0.9 and isinstance(a["in_range"], bool) and c["calibrated"] == (c["n"] >= 9)
            assert c["interval"] is None if not c["calibrated"] else c["interval"][0] <= a["expected_speed"]
            # Advice is the interval's lower edge: none while it is unbounded, never above the answer.
            assert ("advice" in a) <= c["calibrated"]
            assert "advice" not in a or a["advice"]["speed"] <= c["interval"][0] + 1e-3  # (3 decimals)
        advised = [a["advice"]["speed"] for a in answers(sniffer, dev, "speed") if "advice" in a]
        speed = advised[0]  # the print's first advice is the one applied, once per print
        assert moonraker.scripts == [velocity_script(speed)]
        assert moonraker.max_velocity == float(velocity_script(speed).split("=")[1]) <= 200.0
        # The print ends: the trainer puts the printer's own limit back and reads it back.
        moonraker.print_state = "complete"
        fleet_procs.wait_for(lambda: moonraker.max_velocity == 300.0, 30, "the printer's own limit back")
        fleet_procs.wait_for(
            lambda: serving_status(fleet_procs, dev).get("moonraker", {}).get("restored") == 1,
            30,
            "the status",
        )
        status = serving_status(fleet_procs, dev)
        assert status["moonraker"] | {"last": None} == status["moonraker"] | {
            "sent": 1, "failed": 0, "restored": 1, "readback_mismatch": 0, "own_limit": 300.0,
            "in_effect": None, "last": None}  # fmt: skip
        assert status["field"]["speed"]["metric"] == "error"
        # The next print: the limit is read again, sent again, and put back when the trainer stops.
        moonraker.print_state = "printing"
        record(work, dev, "printer", "--layers", "2", "--layer-s", "0.3")
        fleet_procs.wait_for(lambda: len(moonraker.scripts) == 3, 30, "the next print's advice")
        proc = fleet_procs.devices[dev]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert moonraker.max_velocity == 300.0 and len(moonraker.scripts) == 4
        assert "restored the printer's own max_velocity 300 (the daemon stops)" in fleet_procs.log(dev)
    finally:
        moonraker.close()

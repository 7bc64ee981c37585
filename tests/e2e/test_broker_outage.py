"""A broker away for longer than a round's deadline: ``serve`` rides it out and
the rounds go on once the broker is back.  Real processes, a real mosquitto killed and restarted
on the same port."""

from __future__ import annotations

import logging
import time

import pytest

from cloud_aggregator.local.broker import start_mosquitto
from cloud_aggregator.local.fleet import aggregator_toml, pflda_task

pytestmark = pytest.mark.broker
log = logging.getLogger(__name__)
#: Guards against a hung test only; nothing here is a timing assertion.
PATIENCE_S = 120.0
DEADLINE_S = 2.0
#: The outage: four round deadlines (the fault being injected, not a wait for an event).
OUTAGE_S = 4 * DEADLINE_S
DEVICES = ("printer1", "printer2")


def start_fleet(fleet_procs) -> None:
    """Both printers and a serve that expects them, with short deadlines (two extensions each)."""
    fleet_procs.start_devices(DEVICES)
    fleet_procs.start_aggregator(
        aggregator_toml(
            fleet_procs.broker_url,
            fleet_procs.work / "aggregator",
            [pflda_task(rounds=200)],
            expected=list(DEVICES),
            deadline_s=DEADLINE_S,
            min_participants=2,
            max_extensions=2,
        )
    )


def test_serve_rides_out_a_broker_outage_of_four_deadlines(fleet_procs, mosquitto, tmp_path):
    start_fleet(fleet_procs)
    fleet_procs.wait_for(lambda: len(fleet_procs.rounds()) >= 2, PATIENCE_S, "two rounds before the outage")
    mosquitto.kill()
    time.sleep(OUTAGE_S)
    back = start_mosquitto(mosquitto.port, log_file=tmp_path / "mosquitto2.log")
    back_at = time.time()
    try:
        fleet_procs.wait_for(
            lambda: any(r.status == "completed" and r.started > back_at for r in fleet_procs.rounds()),
            PATIENCE_S,
            "a round started and completed after the broker came back",
        )
        done = min(
            r.finished for r in fleet_procs.rounds() if r.status == "completed" and r.finished > back_at
        )
        log.warning("recovered %.2f s after the broker came back", done - back_at)
        assert fleet_procs.aggregator.poll() is None, fleet_procs.log("aggregator")[-4000:]
        text = fleet_procs.log("aggregator")
        assert "Traceback" not in text, text[-4000:]
        for d in DEVICES:
            assert "Traceback" not in fleet_procs.log(d), fleet_procs.log(d)[-4000:]
    finally:
        fleet_procs.stop_all()
        back.stop()


def test_serve_rides_out_a_broker_flap_while_it_checks_for_another_aggregator(
    fleet_procs, mosquitto, tmp_path
):
    """Issue 36: the broker goes away within the first second after ``serve`` connects, before it
    holds the fleet's lock.  No other aggregator exists: ``serve`` must wait for the broker, check
    again and go on to complete rounds, not exit saying another aggregator is running."""
    start_fleet(fleet_procs)
    fleet_procs.wait_for(
        lambda: "connected to" in fleet_procs.log("aggregator"), PATIENCE_S, "serve's first connection"
    )
    assert "only aggregator" not in fleet_procs.log("aggregator")  # still checking for another one
    mosquitto.kill()
    time.sleep(DEADLINE_S / 2)  # the fault: the broker away for a moment
    back = start_mosquitto(mosquitto.port, log_file=tmp_path / "mosquitto2.log")
    try:
        fleet_procs.wait_for(
            lambda: any(r.status == "completed" for r in fleet_procs.rounds()),
            PATIENCE_S,
            "a completed round after the broker came back",
        )
        text = fleet_procs.log("aggregator")
        assert "another aggregator is running" not in text, text[-4000:]
        assert "checking again" in text, text[-4000:]  # the flap hit the check, as the fault meant
        assert fleet_procs.aggregator.poll() is None, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
    finally:
        fleet_procs.stop_all()
        back.stop()

"""A device restarted mid-round re-sends the upload already counted: routine, ``resent``, never
a refusal, and the ledger adds up: counted + refused + resent == seen."""

from __future__ import annotations

import pytest

from cloud_aggregator.local.fleet import Sniffer, aggregator_toml, pflda_task
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import topics

P1, P2 = "printer1", "printer2"


@pytest.mark.broker
def test_a_restarted_devices_resend_is_counted_as_resent_not_refused(fleet_procs):
    sniffer = Sniffer(fleet_procs.broker_url)
    try:
        # Prepare: round 1 waits for both printers; only printer1 is up, and answers.
        fleet_procs.start_device(P1)
        status = topics.topic_status(fleet_procs.fleet, P1)
        fleet_procs.wait_for(  # the sniffer is subscribed before any upload can be sent
            lambda: any(t == status for t, _ in list(sniffer.messages)), 60, "printer1's status"
        )
        fleet_procs.start_aggregator(
            aggregator_toml(
                fleet_procs.broker_url,
                fleet_procs.work / "aggregator",
                [pflda_task(rounds=2)],
                expected=[P1, P2],
                deadline_s=120,
                startup_wait_s=0.5,
            )
        )
        answered = f"{P1}: task speed round 1 train"
        fleet_procs.wait_for(lambda: answered in fleet_procs.log(P1), 90, "printer1's round-1 answer")
        # Execute: printer1 restarts mid-round; it re-sends its round-1 upload on the announcement.
        fleet_procs.devices[P1].terminate()
        fleet_procs.devices[P1].wait(30)
        fleet_procs.start_device(P1)
        fleet_procs.wait_for(
            lambda: f"from {P1}: resent" in fleet_procs.log("aggregator"), 90, "the re-send's verdict"
        )
        fleet_procs.start_device(P2)
        assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")
        up = topics.topic_up(fleet_procs.fleet, "speed", P1).removesuffix(P1)
        seen = sum(t.startswith(up) for t, _ in list(sniffer.messages))
    finally:
        sniffer.stop()

    # Assert: the copy is resent (not stale_round, not replay), and every upload is accounted for.
    store = SqliteStore(fleet_procs.db, readonly=True)
    try:
        by_reason = store.rejection_counts_by_reason("speed")
    finally:
        store.close()
    assert by_reason == {P1: {"resent": 1}}
    records = fleet_procs.rounds()
    assert [sorted(r.participants) for r in records] == [[P1, P2], [P1, P2]]
    counted = sum(len(r.participants) for r in records)
    refused = sum(n for per in by_reason.values() for code, n in per.items() if code != "resent")
    resent = sum(per.get("resent", 0) for per in by_reason.values())
    assert (counted, refused, resent) == (4, 0, 1)
    assert counted + refused + resent == seen

"""What the console's JSON says of a revoked device and of re-sent uploads."""

from __future__ import annotations

from cloud_aggregator.console.fleet_view import FleetView, StoreData


def test_revoked_devices_and_resent_copies_are_marked_apart():
    store = StoreData(refused={"speed": {"printer1": {"resent": 2, "replay": 1}, "printer3": {"resent": 1}}})
    statuses = {"printer1": {"state": "online"}, "printer2": {"state": "online"}}
    view = FleetView("plant", store, statuses, revoked={"printer2"}).to_json()
    devices = {d["device"]: d for d in view["devices"]}
    assert (devices["printer2"]["revoked"], devices["printer2"]["online"]) == (True, False)
    assert (devices["printer1"]["revoked"], devices["printer1"]["online"]) == (False, True)
    assert devices["printer1"]["uploads_refused"] == {"replay": 1}
    assert devices["printer1"]["uploads_resent"] == 2
    assert devices["printer3"]["uploads_refused"] == {} and devices["printer3"]["uploads_resent"] == 1

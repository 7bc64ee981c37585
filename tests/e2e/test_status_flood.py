"""One enrolled device floods retained statuses, each claiming a new connection:
``serve`` keeps running, restates the announcement to it at most once per announcement,
and the other devices' rounds go on.  Real processes, a real mosquitto (the benchmark's
``--quick`` case: a 10 s flood)."""

from __future__ import annotations

import pytest

from benchmarks import status_flood
from tests.conftest import _require_mosquitto

pytestmark = pytest.mark.broker


def test_a_status_flood_from_one_device_neither_stops_serve_nor_the_others_rounds():
    _require_mosquitto()
    r = status_flood.main(["--quick", "--no-write"])
    assert r["serve_alive"] and not r["traceback"]
    assert r["rounds_flood"] >= 1  # the other devices' rounds went on during the flood
    # Before: one restated announcement per status (1:1); now at most one per announcement.
    assert r["restated"] <= r["announced"] + 1
    assert r["statuses_sent"] > 10 * (r["restated"] + 1)
    assert r["rss_after_mib"] <= 1.5 * r["rss_before_mib"]

"""The demo's served cell from a device's round report (``cloud_aggregator.local.demo.served``)."""

from __future__ import annotations

from cloud_aggregator.local.demo import LOSS_SCALE, served

REPORT = {"test_loss": 0.01, "served_test_loss": 0.002, "serves_personal": 0.0, "serves_global": 1.0,
          "serves_alone": 0.0}  # fmt: skip


def test_the_cell_names_the_candidate_and_the_round_the_gate_kept():
    assert served(REPORT | {"served_round": 7.0}, 7) == (LOSS_SCALE * 0.002, "global")
    assert served(REPORT | {"served_round": 3.0}, 7) == (LOSS_SCALE * 0.002, "global@3")
    assert served(REPORT, 7) == (LOSS_SCALE * 0.002, "global")  # a report from before served_round


def test_a_device_that_serves_nothing_has_no_cell():
    assert served({"test_loss": 0.01}, 7) is None

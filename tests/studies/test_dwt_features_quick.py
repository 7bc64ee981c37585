"""The feature benchmark runs end to end in --quick; it checks features, never times."""

from __future__ import annotations

from benchmarks import dwt_features


def test_quick_dwt_features_checks_precision_and_reports_every_row():
    out = dwt_features.main(["--quick", "--no-write", "--batch", "2"])
    rows = out["rows"]
    assert len(rows) == 8 and sum("(reference)" in name for name in rows) == 2
    for r in rows.values():
        assert r["wall_min"] <= r["wall"] <= r["wall_max"] and r["ratio_lo"] <= r["ratio"] <= r["ratio_hi"]
    # The float64 path matches the independent reference; the default stays inside its contract.
    assert out["max_rel"] < 1e-8 and 0 <= out["tolerance_used"] <= 1.0
    fast, channels = out["float32_channels"]
    assert 0 < fast <= channels  # the float32 path is the one being timed

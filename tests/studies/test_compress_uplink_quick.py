"""The compressed-uplink benchmark runs end to end in --quick: bytes, round trips, unbiasedness; no times."""

from __future__ import annotations

from benchmarks import compress_uplink


def test_quick_compress_uplink_checks_bytes_and_unbiasedness():
    out = compress_uplink.main(["--quick", "--no-write"])
    assert out["bytes"][1]["ratio"] >= 25  # 1 bit: at most 1/25 of float32's payload
    assert out["bytes"][8]["ratio"] > 3.9
    for r in out["unbiased"].values():  # rotated: the mean of K decodings is as close as unbiased draws allow
        assert r["bias"] < 3 * r["nmse"] / r["k"]
    unrotated = out["unrotated"]  # no rotation: the same bits every time, the error never averages out
    assert unrotated["bias"] > 10 * unrotated["nmse"] / unrotated["k"]

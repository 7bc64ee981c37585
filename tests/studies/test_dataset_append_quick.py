"""The dataset-append benchmark runs: append-only segments write bytes in proportion to the row,
within the target, and far fewer than the old whole-file rewrite (bytes counted, never times)."""

from __future__ import annotations

from benchmarks import dataset_append


def test_quick_dataset_append_counts_bytes_old_against_new():
    out = dataset_append.main(["--quick", "--no-write"])
    assert {(r["kind"], r["n"]) for r in out["results"]} == {("printer layer", 1_000), ("weld", 1_000)}
    for r in out["results"]:
        old, new = r["old"], r["new"]
        assert old["mean"] >= r["n"] * r["row_bytes"]  # the old method rewrote the whole dataset
        assert new["mean"] <= r["bound"] == 2 * r["row_bytes"] + 4096  # the target, compaction included
        assert new["merges"] >= 1  # the window held merges, so their bytes are in the mean
        assert new["mean"] < old["mean"] and new["read"] < old["read"]

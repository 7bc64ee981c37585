"""The collecting-thread benchmark runs end to end: every queued upload counted, the round's mean
the bits of folding each in arrival order (``run_case`` raises otherwise), never a time asserted."""

from __future__ import annotations

from benchmarks import ingest_thread


def test_quick_ingest_thread_counts_every_upload_bit_exactly():
    figures = ingest_thread.main(["--quick", "--no-write"])
    assert list(figures) == ["this tree"] and len(figures["this tree"]) == 1
    assert ingest_thread.measure(50)["got"] == 50

"""The DP accuracy study, quick mode: every row fills, each DP run's own ledger stays within its
ε (``dp_rows`` checks it), and on the printers ε = 1 costs more than no DP at all."""

from __future__ import annotations

from dataclasses import replace

from benchmarks import dp_accuracy as study
from benchmarks import ftltp_welding as weld


def _score(cell: object) -> float:
    return float(str(cell).split(" ± ")[0].split()[-1])


def test_quick_study_fills_the_table_and_privacy_has_a_price():
    rows, body = study.study([0], 10, replace(weld.quick_config(), rounds=4, workers=1, standardize="group"))
    labels = [(r[0], r[1]) for r in rows]
    for task in ("printers (PFL-DA)", "welds (FTL-TP, M+S)"):
        assert [e for t, e in labels if t == task] == ["none", "8", "4", "1"]
    printers = {r[1]: _score(r[7]) for r in rows if r[0] == "printers (PFL-DA)"}
    assert printers["1"] > printers["none"]
    assert all(0.0 <= _score(c) <= 1.0 for r in rows if r[0].startswith("welds") for c in r[7:9])
    assert "| printers (indiv: nothing shared)" in body

"""The device package in short modules with one job (issue 34): ``benchmarks.structure``'s figures for
``edge``, pinned on the real code."""

from __future__ import annotations

from benchmarks.structure import LONG_FUNCTION, LONG_MODULE, long_pieces


def test_no_edge_module_is_over_400_lines_and_at_most_three_functions_are_over_50():
    functions, modules = long_pieces("edge")
    assert modules == [], f"edge modules over {LONG_MODULE} lines: split them by job"
    assert len(functions) <= 3, f"edge functions over {LONG_FUNCTION} lines: {functions}"

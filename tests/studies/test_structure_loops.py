"""No package loops between its subpackages: ``benchmarks.structure``'s count, checked on the real code.

``lint-imports`` enforces the same with one ``acyclic_siblings`` contract per package; this pins the
figure ``python -m benchmarks.structure`` reports, and that it sees a loop no single module makes.
"""

from __future__ import annotations

import pytest

from benchmarks.structure import cycles, import_graph, sibling_cycles


def test_a_loop_between_two_subpackages_counts_though_no_module_loops():
    graph = {
        "a": set(),
        "a.b": set(),
        "a.b.x": {"a.c.y"},
        "a.c": set(),
        "a.c.y": set(),
        "a.c.z": {"a.b.w"},
        "a.b.w": set(),
        "a.d": {"a.b.x"},
    }
    assert cycles(graph) == []
    assert sibling_cycles(graph) == [["a.b", "a.c"]]
    assert sibling_cycles({**graph, "a.c.z": set()}) == []


@pytest.mark.parametrize(
    "package", ["cloud_aggregator", "edge", "sensors", "ioft_protocol", "trainer_lite", "export"]
)
def test_no_package_loops_between_its_subpackages(package):
    graph = import_graph(package)
    assert cycles(graph) == [] and sibling_cycles(graph) == []

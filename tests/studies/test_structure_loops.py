"""No package loops between its subpackages: ``benchmarks.structure``'s count, checked on the real code.

``lint-imports`` enforces the same with one ``acyclic_siblings`` contract per package; this pins the
figure ``python -m benchmarks.structure`` reports, and that it sees a loop no single module makes.
"""

from __future__ import annotations

import pytest

from benchmarks.structure import cycles, duplicates, import_graph, sibling_cycles


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


def test_a_repeated_run_of_code_counts_once_and_signatures_docstrings_imports_do_not(tmp_path, monkeypatch):
    body = "".join(f"    x{i} = a + {i}\n" for i in range(7))
    pkg = tmp_path / "dupkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "one.py").write_text(f'import os\n\n\ndef f(\n    a,\n):\n    """One."""\n{body}')
    (pkg / "two.py").write_text(
        f'import sys\n\n\ndef g(\n    a,\n    b=1,\n):\n    """Two."""\n    # why\n{body}'
    )
    (pkg / "three.py").write_text("def h(a):\n" + body.replace("x6", "y6").replace("x1", "y1"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert duplicates("dupkg") == [("dupkg/one.py:8", "dupkg/two.py:10")]

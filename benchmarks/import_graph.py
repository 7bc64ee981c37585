"""Which project package imports which: counts of cross-package imports, and how many sit inside functions.

``python -m benchmarks.import_graph`` prints one line per (from, to) pair and the total of
project imports inside functions (a lazy import is sometimes right, e.g. torch only for the
commands that train; one that only dodges a cycle is a smell).  The directions themselves are
enforced by ``lint-imports`` (``[tool.importlinter]`` in pyproject.toml); this shows the weights.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

PACKAGES = (
    "ioft_protocol",
    "edge",
    "sensors",
    "trainer_lite",
    "cloud_aggregator",
    "export",
    "benchmarks",
    "checks",
    "deploy",
    "tests",
)


def import_graph(root: Path) -> tuple[Counter, Counter, int]:
    """``(imports per (from, to), of those inside functions, all project imports inside functions)``."""
    counts: Counter = Counter()
    in_function: Counter = Counter()
    total_in_function = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] not in PACKAGES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nested = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for n in ast.walk(f)
            if isinstance(n, ast.Import | ast.ImportFrom)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                target = module.split(".")[0]
                if target not in PACKAGES:
                    continue
                total_in_function += id(node) in nested
                if target != rel.parts[0]:
                    counts[(rel.parts[0], target)] += 1
                    in_function[(rel.parts[0], target)] += id(node) in nested
    return counts, in_function, total_in_function


def main(argv: list[str] | None = None) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    counts, in_function, total = import_graph(root)
    for (src, dst), n in sorted(counts.items()):
        print(f"{src:>17} -> {dst:<17} {n:4d}  ({in_function[(src, dst)]} inside functions)")
    print(f"project imports inside functions: {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

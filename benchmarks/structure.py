"""The shape of one package: its modules, its import cycles, how many layers deep its imports go,
and the modules one upload passes through in ``MqttFleet.collect``.

``python -m benchmarks.structure [PACKAGE]`` (default ``cloud_aggregator``) prints

- ``modules``: the package's modules (every ``.py`` file, ``__init__`` included);
- ``cycles``: groups of modules that import each other in a loop (strongly connected components
  of the import graph, ``if TYPE_CHECKING:`` and function-level imports included: a loop held open
  by either is still a loop), each listed;
- ``cycles between subpackages``: groups of one package's children (a module, or a subpackage
  with everything under it) that import each other in a loop, as ``lint-imports``'
  ``acyclic_siblings`` contracts forbid them, each listed;
- ``duplicates``: pairs of places in the package's modules that share a run of
  :data:`DUPLICATE_LINES` or more code lines (blank lines, comments, imports, docstrings and
  signatures left out;
  a longer run counts once), each listed;
- ``layers``: the longest chain of imports inside the package (a cycle counts as one layer);
- ``upload``: for ``cloud_aggregator``, the project modules one upload's handling runs through in
  ``MqttFleet.collect`` (a traced run with an in-memory session, no broker), in order, and how
  often it comes back to a module it already left: an accepted upload, one accepted into a
  streaming round (folded into the running sum), and two refused ones;
- ``long``: the package's functions over 50 lines and modules over 400 lines (``def`` to its
  last line, docstring included), longest first.

The graph is import-linter's own (grimp), so the figures agree with ``lint-imports``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import grimp

PROJECT = ("cloud_aggregator", "ioft_protocol", "trainer_lite")


def import_graph(package: str) -> dict[str, set[str]]:
    """``module -> the modules of the package it imports``."""
    graph = grimp.build_graph(package, include_external_packages=False, cache_dir=None)
    modules = graph.find_descendants(package) | {package}
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def sibling_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Loops among the children of one package, each child standing for everything under it.

    What import-linter's ``acyclic_siblings`` contract forbids: ``a.b.x`` importing ``a.c.y`` and
    ``a.c.z`` importing ``a.b.w`` is a loop between ``a.b`` and ``a.c`` though no module loops.
    """
    found: list[list[str]] = []
    for parent in sorted(m for m in graph if any(n.startswith(m + ".") for n in graph)):
        depth = parent.count(".") + 1

        def child(m: str, parent: str = parent, depth: int = depth) -> str | None:
            return ".".join(m.split(".")[: depth + 1]) if m.startswith(parent + ".") else None

        folded: dict[str, set[str]] = {}
        for m, targets in graph.items():
            if (a := child(m)) is not None:
                folded.setdefault(a, set()).update(b for t in targets if (b := child(t)) not in (None, a))
        for b in set().union(*folded.values()) if folded else ():
            folded.setdefault(b, set())
        found += cycles(folded)
    return found


#: The shortest run of lines counted as repeated code (blank lines, comments, imports, docstrings and
#: signatures left out).
DUPLICATE_LINES = 6


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, stripped text)`` of the lines that are code: no blank line, comment, import,
    docstring (a string standing alone as a statement) or signature (the methods of one interface
    share theirs)."""
    text = path.read_text()
    skip: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        alone = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if alone or isinstance(node, ast.Import | ast.ImportFrom):
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # one interface's signatures
            skip.update(range(node.lineno, node.body[0].lineno))
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.strip()
        if code and not code.startswith("#") and number not in skip:
            out.append((number, code))
    return out


def duplicates(package: str, min_lines: int = DUPLICATE_LINES) -> list[tuple[str, str]]:
    """Pairs of places in the package's modules with the same ``min_lines`` code lines or more.

    Each repeated run counts once however long it is: ``"path:line"`` of both its copies.
    """
    root = Path(__import__(package).__file__).parent
    files = {str(f.relative_to(root.parent)): _code_lines(f) for f in sorted(root.rglob("*.py"))}
    where: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    for name, lines in files.items():
        for i in range(len(lines) - min_lines + 1):
            where.setdefault(tuple(t for _, t in lines[i : i + min_lines]), []).append((name, i))
    same = {(a, b) for places in where.values() for k, a in enumerate(places) for b in places[k + 1 :]}
    pairs = []
    for (fa, ia), (fb, ib) in sorted(same):
        if ((fa, ia - 1), (fb, ib - 1)) not in same:  # the run starts here
            pairs.append((f"{fa}:{files[fa][ia][0]}", f"{fb}:{files[fb][ib][0]}"))
    return pairs


def layers(graph: dict[str, set[str]], loops: list[list[str]]) -> int:
    """The longest chain of imports, each cycle taken as one module."""
    group = {m: m for m in graph}
    for loop in loops:
        for m in loop:
            group[m] = loop[0]
    edges: dict[str, set[str]] = {g: set() for g in group.values()}
    for m, targets in graph.items():
        edges[group[m]] |= {group[t] for t in targets if group[t] != group[m]}
    depth: dict[str, int] = {}

    def walk(node: str) -> int:
        if node not in depth:
            depth[node] = 0  # a placeholder: the condensed graph has no loop
            depth[node] = 1 + max((walk(t) for t in edges[node]), default=0)
        return depth[node]

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    return max((walk(n) for n in edges), default=0)


def traced_modules(run: Callable[[], object]) -> list[str]:
    """The project modules ``run`` executes in, in order (a module repeated only after another)."""
    seen: list[str] = []

    def note(frame) -> None:
        name = frame.f_globals.get("__name__", "") if frame is not None else ""
        if name.split(".")[0] in PROJECT and (not seen or seen[-1] != name):
            seen.append(name)

    def profile(frame, event, arg) -> None:
        if event == "call":
            note(frame)
        elif event == "return":
            note(frame.f_back)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


#: What counts as long: a function over this many lines, a module over this many.
LONG_FUNCTION, LONG_MODULE = 50, 400


def long_pieces(package: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The package's functions over :data:`LONG_FUNCTION` lines and modules over :data:`LONG_MODULE`
    lines, each as ``(lines, name)``, longest first."""
    spec = importlib.util.find_spec(package)
    roots = [] if spec is None or spec.submodule_search_locations is None else spec.submodule_search_locations
    functions: list[tuple[int, str]] = []
    modules: list[tuple[int, str]] = []
    for path in sorted(f for root in roots for f in Path(root).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        parts = path.relative_to(roots[0]).with_suffix("").parts
        name = ".".join([package, *parts[: -1 if parts[-1] == "__init__" else None]])
        if len(source.splitlines()) > LONG_MODULE:
            modules.append((len(source.splitlines()), name))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LONG_FUNCTION:
                    functions.append((lines, f"{name}:{node.name}"))
    return sorted(functions, reverse=True), sorted(modules, reverse=True)


def upload_paths() -> dict[str, list[str]]:
    """One accepted and one refused upload through ``MqttFleet.collect``: the modules each runs through."""
    from dataclasses import replace

    import numpy as np

    from benchmarks.common import QueuedSession
    from cloud_aggregator.aggregation.streaming import RoundFold
    from cloud_aggregator.rounds.types import CollectRequest
    from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
    from cloud_aggregator.store.sqlite import SqliteStore
    from ioft_protocol import codec, round_messages, topics
    from ioft_protocol.mqtt_inbound import Message
    from trainer_lite.params import param_hash
    from trainer_lite.task import TaskSpec

    g = {"w": np.linspace(-1, 1, 8, dtype=np.float32), "b": np.zeros(1, np.float32)}
    spec = TaskSpec("t", "fedavg", "sigmoid_glm", rounds=3)
    paths: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "agg")
        session = QueuedSession()
        fleet = MqttFleet(
            session, "f", CollectPolicy(deadline_s=0.2, expected=("d0",), max_extensions=0), store
        )
        request = CollectRequest(
            spec=spec,
            round=1,
            phase="train",
            global_params=g,
            global_hash=param_hash(g),
            downlinks={},
            expected={n: codec.TensorSpec(tuple(v.shape), v.dtype.name) for n, v in g.items()},
        )
        fleet.holdouts["t"] = ("d1",)
        # Its handling starts in ``handle`` (the message read) and, where uploads are ingested in
        # batches, goes on in the fleet's ``_ingest`` or its ``ingest.take`` (judged, stored, folded,
        # filed: ``cloud_aggregator.rounds.ingest``): each is traced where the fleet has it.
        places = [(fleet, "handle"), (fleet, "_ingest"), (getattr(fleet, "ingest", None), "take")]
        steps = [(owner, name) for owner, name in places if owner is not None and hasattr(owner, name)]
        cases = (
            ("accepted", "d0", 1, False),
            ("accepted into a streaming round (folded)", "d0", 1, True),
            ("refused by admission (a stale round)", "d0", 0, False),
            ("refused as held out", "d1", 1, False),
        )
        for r, (case, device, round_, streams) in enumerate(cases):
            # Each case its own round (a stale upload quotes the one before it).
            fold = RoundFold(lambda u: float(u.n_samples)) if streams else None
            opened = replace(request, round=request.round + r, fold=fold)
            up = round_messages.UpdateMessage(
                "f", "t", device, opened.round + round_ - 1, "train", 10, opened.global_hash, {}, g
            )
            session.queue.append(Message(topics.topic_up("f", "t", device), up.encode(), False))
            path: list[str] = []
            for owner, name in steps:
                step = getattr(owner, name)
                setattr(
                    owner,
                    name,
                    lambda *a, step=step, path=path, **k: path.extend(traced_modules(lambda: step(*a, **k))),
                )
            fleet.collect(opened)
            for owner, name in steps:
                delattr(owner, name)
            paths[case] = [m for i, m in enumerate(path) if i == 0 or path[i - 1] != m]
        store.close()
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.structure", description=__doc__.split("\n")[0]
    )
    parser.add_argument("package", nargs="?", default="cloud_aggregator")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the traced rounds' own log lines
    graph = import_graph(args.package)
    loops = cycles(graph)
    print(f"{args.package}: {len(graph)} modules, {len(loops)} import cycles, {layers(graph, loops)} layers")
    for loop in loops:
        print("  cycle: " + " <-> ".join(loop))
    repeated = duplicates(args.package)
    print(
        f"{args.package}: {len(repeated)} duplicates (pairs of places sharing {DUPLICATE_LINES}+ code lines)"
    )
    for a, b in repeated:
        print(f"  duplicate: {a} = {b}")
    siblings = sibling_cycles(graph)
    print(f"{args.package}: {len(siblings)} import cycles between the subpackages of one package")
    for loop in siblings:
        print("  cycle: " + " <-> ".join(loop))
    if args.package == "cloud_aggregator":
        for case, path in upload_paths().items():
            inside = [m for m in path if m.startswith("cloud_aggregator")]
            inside = [m for i, m in enumerate(inside) if i == 0 or inside[i - 1] != m]
            print(
                f"one upload, {case}: {len(set(inside))} cloud_aggregator modules, "
                f"{len(inside) - len(set(inside))} returns to one already left"
                f" ({len(set(path))} project modules, {len(path) - len(set(path))} returns)"
            )
            print("  " + " > ".join(m.removeprefix("cloud_aggregator.") for m in inside))
    functions, modules = long_pieces(args.package)
    print(
        f"{args.package}: {len(functions)} functions over {LONG_FUNCTION} lines, "
        f"{len(modules)} modules over {LONG_MODULE} lines"
    )
    for lines, name in functions + modules:
        print(f"  {lines:4d} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

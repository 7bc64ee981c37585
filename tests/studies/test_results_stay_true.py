"""Results files say what produced them, and are regenerated when that code changes.

The quick figures themselves are compared in each study's own quick test
(``benchmarks.quick_figures.drift``, one run serves both); here: every results file
names its command and commit, a file whose recorded commit is older than a change to its
study's module is stale, and the drift check itself finds a changed figure.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import quick_figures
from benchmarks.common import RESULT_PACKAGES, commit_line, header

ROOT = Path(__file__).resolve().parents[2]
COMMIT = re.compile(r"^Commit: ([0-9a-f]{7,40})(.*)$", re.M)
MODULE = re.compile(rf"python3? -m ({'|'.join(RESULT_PACKAGES)})\.([a-z_0-9]+)")
FILES = sorted(p for pkg in RESULT_PACKAGES for p in (ROOT / pkg / "results").glob("*.md"))


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def _has_history() -> bool:
    done = _git("rev-list", "--count", "HEAD")
    return done.returncode == 0 and int(done.stdout.strip() or 0) > 1


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_results_file_names_its_command_and_commit(path: Path) -> None:
    head = "\n".join(path.read_text().split("\n")[:12])
    assert COMMIT.search(head), (
        f"{path.name}: no 'Commit: <sha>' line near the top (benchmarks.common.header)"
    )
    assert MODULE.search(path.read_text()), f"{path.name}: names no `python -m <package>.<module>` command"


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_a_recorded_commit_is_not_older_than_its_study(path: Path) -> None:
    """A run that recorded its commit (not a backfilled one): its study's module is unchanged since."""
    if not _has_history():
        pytest.skip("no git history here (a shallow or exported tree)")
    text = path.read_text()
    found = COMMIT.search("\n".join(text.split("\n")[:12]))
    if found is None or "backfilled" in found.group(2):
        pytest.skip(f"{path.name}: its commit was backfilled from git, not recorded by the run")
    sha, rest = found.groups()
    command = re.search(r"^Command: `([^`]*)`", text, re.M)
    assert "uncommitted" not in rest, (
        f"{path.name} was written from a dirty tree: rerun `{command and command[1]}`"
    )
    if _git("cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        pytest.skip(f"{path.name}: commit {sha} is not in this history (a rebase or a shallow clone)")
    module = ROOT.joinpath(*MODULE.search(text).groups()).with_suffix(".py")
    changed = _git("log", "--format=%h %s", f"{sha}..HEAD", "--", str(module.relative_to(ROOT)))
    assert changed.returncode == 0, changed.stderr
    stale = [
        c
        for c in changed.stdout.splitlines()
        if not (_imports_only(c.split()[0], module) or _docstrings_only(c.split()[0], module))
    ]
    assert not stale, (
        f"{path.name} is stale: {module.name} changed after {sha} ({'; '.join(stale)}); "
        f"rerun `{command and command[1]}`"
    )


#: Lines a change may touch without changing a figure: imports (a module moved) and comments.
_NO_FIGURE = re.compile(r"^(from \S+ import .*|import \S+.*|#.*|[A-Za-z_][A-Za-z_0-9]*,?|\)|)$")
#: A dotted module path of the project's, which a move renames in docstrings and comments.
_PATH = re.compile(r"\b(cloud_aggregator|edge|sensors|trainer_lite|ioft_protocol|export)(\.[a-z_0-9]+)+")


def _imports_only(commit: str, module: Path) -> bool:
    """Whether ``commit`` changed only the imports, comments and module paths named in the text of
    ``module`` (a moved module's new path changes no figure, so it does not make results stale)."""
    rel = str(module.relative_to(ROOT))
    if _same_figures(_git("show", "--format=", "-U0", commit, "--", rel).stdout):
        return True  # (a merge's combined diff is empty where it took each side as it was)
    # A merge that resolved the module: what it changed against a side that had it.  Each side's own
    # commits are in the log and checked one by one; a resolution that wrote new code differs from both.
    parents = _git("rev-list", "--parents", "-n", "1", commit).stdout.split()[1:]
    return len(parents) > 1 and any(
        _git("cat-file", "-e", f"{p}:{rel}").returncode == 0
        and _same_figures(_git("diff", "-U0", p, commit, "--", rel).stdout)
        for p in parents
    )


def _same_figures(diff: str) -> bool:
    """Whether a ``-U0`` diff changes only imports, comments and module paths."""
    sides: dict[str, list[str]] = {"-": [], "+": []}
    for line in diff.splitlines():
        if line[:1] in sides and not line.startswith(("+++", "---")):
            text = line[1:].strip()
            if not _NO_FIGURE.match(text):
                sides[line[0]].append(_PATH.sub("MODULE", text))
    return sorted(sides["-"]) == sorted(sides["+"])


def _code(source: str) -> str:
    """The module's syntax tree without its docstrings (module, class and function)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _docstrings_only(commit: str, module: Path) -> bool:
    """Whether ``commit`` changed only docstrings (and comments) of ``module``: its code, and so
    every figure, is the same on both sides."""
    rel = module.relative_to(ROOT).as_posix()
    before, after = _git("show", f"{commit}^:{rel}"), _git("show", f"{commit}:{rel}")
    if before.returncode != 0 or after.returncode != 0:
        return False
    return _code(before.stdout) == _code(after.stdout)


def test_docstring_edits_leave_results_fresh_and_code_edits_do_not() -> None:
    doc = '"""Study (issue 3)."""\nX = 1\n\n\ndef f():\n    """Once."""\n    return X\n'
    assert _code(doc) == _code(doc.replace("(issue 3)", "").replace("Once.", "Twice."))
    assert _code(doc) != _code(doc.replace("X = 1", "X = 2"))


def test_header_names_command_commit_and_machine() -> None:
    text = header("x", "python -m benchmarks.x --seeds 0")
    assert "Command: `python -m benchmarks.x --seeds 0`" in text
    assert f"Commit: {commit_line()}" in text and "Machine: " in text


def test_drift_names_a_changed_missing_or_new_figure(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(quick_figures, "QUICK", tmp_path)
    quick_figures.write("newcomer", {"a": 1.0, "b": 2.0})
    assert quick_figures.drift("newcomer", {"a": 1.0, "b": 2.0}) == []
    lines = quick_figures.drift("newcomer", {"a": 1.0 + 1e-6, "c": 3.0})
    assert any(line.startswith("a: recorded 1.0") for line in lines)
    assert "b: recorded, not produced" in lines and "c: produced, not recorded" in lines


@pytest.mark.parametrize("name", sorted(quick_figures.STUDIES))
def test_every_quick_study_has_recorded_figures(name: str) -> None:
    doc = quick_figures.recorded(name)
    assert doc.get("figures"), (
        f"nothing recorded for {name}: run python -m benchmarks.quick_figures --write {name}"
    )
    assert doc["commit"] and doc["study_command"]

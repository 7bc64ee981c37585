"""The architecture page's picture stays what the import contracts give, and its names stay real.

``python -m benchmarks.architecture --check`` is the step of ``make lint`` that fails on a stale
picture; these tests run it on the repository and on copies of it whose contracts or page changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import architecture

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.architecture", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The repository's contracts and pages copied, its packages linked: a tree to change."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    for package in [*architecture.contracts()["root_packages"], "tests"]:
        (tmp_path / package).symlink_to(ROOT / package)
    return tmp_path


def test_the_page_shows_what_the_contracts_give_and_names_only_real_modules():
    done = run("--check")
    assert (done.returncode, done.stderr) == (0, "")


def test_a_changed_contract_fails_the_check_in_one_line_that_names_the_command_that_redraws(copy: Path):
    # The store and the round engine swap floors: rounds may then import store, not the reverse.
    toml = copy / "pyproject.toml"
    text = toml.read_text()
    assert '"cloud_aggregator.store",\n    "cloud_aggregator.rounds",' in text
    toml.write_text(
        text.replace(
            '"cloud_aggregator.store",\n    "cloud_aggregator.rounds",',
            '"cloud_aggregator.rounds",\n    "cloud_aggregator.store",',
        )
    )
    done = run("--check", "--root", str(copy))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "docs/architecture.md: the picture differs from the import contracts in pyproject.toml; "
        "run: python -m benchmarks.architecture --write"
    ]
    assert run("--write", "--root", str(copy)).returncode == 0
    page = (copy / "docs/architecture.md").read_text()
    assert "cloud_aggregator_rounds --> cloud_aggregator_store" in page
    assert "cloud_aggregator_store --> cloud_aggregator_rounds" not in page
    assert run("--check", "--root", str(copy)).returncode == 0


def test_a_picture_edited_by_hand_fails_the_check(copy: Path):
    page = copy / "docs/architecture.md"
    page.write_text(page.read_text().replace("edge --> ioft_protocol", "edge --> cloud_aggregator"))
    assert architecture.problems(copy) == [
        "docs/architecture.md: the picture differs from the import contracts in pyproject.toml; "
        "run: python -m benchmarks.architecture --write"
    ]


def test_a_page_that_names_a_module_file_or_name_that_does_not_exist_fails_the_check(copy: Path):
    index = copy / "docs/index.md"
    index.write_text(
        index.read_text()
        + "\nSee `cloud_aggregator/rounds/admission.py` (`cloud_aggregator.rounds.admission.Admission`),"
        " `cloud_aggregator/local_fleet.py`, `edge.backbones` and `cloud_aggregator.rounds.admission.Nothing`.\n"
    )
    assert architecture.problems(copy) == [
        f"docs/index.md: `{name}` names no module, file or folder of the project; correct the page"
        for name in (
            "cloud_aggregator.rounds.admission.Nothing",
            "cloud_aggregator/local_fleet.py",
            "edge.backbones",
        )
    ]


def test_an_arrow_left_to_a_longer_path_is_crossed_where_the_contracts_close_that_path():
    # a may import b and b may import c, but a may not import c: the picture must not imply it.
    config = {
        "root_packages": ["a", "b", "c"],
        "contracts": [
            {"name": "up", "type": "forbidden", "source_modules": ["c"], "forbidden_modules": ["a", "b"]},
            {"name": "no skip", "type": "forbidden", "source_modules": ["a"], "forbidden_modules": ["c"]},
            {"name": "b", "type": "forbidden", "source_modules": ["b"], "forbidden_modules": ["a"]},
        ],
    }
    lines = architecture.packages_diagram(config)
    assert "    a --> b" in lines and "    b --> c" in lines
    assert "    a -.-x|never directly| c" in lines


def test_an_unreadable_tree_is_one_line_not_a_traceback(tmp_path: Path):
    done = run("--check", "--root", str(tmp_path))
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert "pass --root with the repository" in done.stderr


def test_a_layers_contract_over_a_container_draws_that_packages_wings_in_layers():
    # How a device-side layers contract would read (import-linter's `containers`): drawn as layers, not loop-free.
    config = {
        "root_packages": ["edge"],
        "contracts": [
            {
                "name": "edge",
                "type": "layers",
                "containers": ["edge"],
                "layers": ["serving", "recording | models"],
            },
            {"name": "no loop", "type": "acyclic_siblings", "ancestors": ["edge"]},
        ],
    }
    wings = architecture.wings_diagram(config, ROOT)
    assert "    edge_serving --> edge_recording" in wings and "    edge_serving --> edge_models" in wings
    assert "edge_pkg" not in "\n".join(architecture.loop_free_diagram(config, ROOT))
    forbidden, _ = architecture.package_rules({**config, "root_packages": ["edge.recording", "edge.models"]})
    assert forbidden == {("edge.recording", "edge.models"), ("edge.models", "edge.recording")}

"""The robust-aggregation results file reproduces itself: the command it names, run again, writes
the same table, and its ratios are to the clean run of the same algorithm with the mean reducer
(the PFL-DA file once named a module that does not exist and compared with FedAvg's run).
The runs are stubbed: what is checked is the study's bookkeeping, not its training."""

from __future__ import annotations

import re
import shlex

import pytest

from benchmarks import common
from benchmarks import robust_aggregation as study

MEAN_LOSS, ROBUST_LOSS = 2.0, 2.5


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    seen = []

    def run_one(clients, algorithm, reducer, attack, seed, rounds, n_attackers):
        seen.append((algorithm, reducer[0], rounds))
        loss = MEAN_LOSS if reducer[0] == "mean" else ROBUST_LOSS
        return study.Run(reducer[0], attack, seed, loss, (loss,) * rounds)

    monkeypatch.setattr(study, "printers", lambda n, cache=True: {})
    monkeypatch.setattr(study, "run_one", run_one)
    monkeypatch.setattr(study, "plot_curves", lambda *a, **k: None)
    monkeypatch.setattr(study, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return seen


def _table(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("|"))


@pytest.mark.parametrize(
    ("argv", "result"),
    [
        (["--seeds", "0", "--rounds", "2"], "robust_aggregation.md"),
        (["--algorithm", "pflda", "--seeds", "0", "--rounds", "2"], "robust_aggregation_pflda.md"),
    ],
)
def test_the_command_in_the_results_file_reproduces_it(fake_runs, tmp_path, argv, result):
    assert study.main(argv) == 0
    first = (tmp_path / result).read_text()
    (command,) = re.findall(r"^Command: `(.*)`", first, re.M)
    program, args = command.split(" ", 3)[:3], shlex.split(command)[3:]
    assert program == ["python", "-m", "benchmarks.robust_aggregation"]
    algorithm = "pflda" if "pflda" in argv else "fedavg"
    runs_before = list(fake_runs)
    assert {a for a, _, _ in runs_before} == {algorithm}
    (tmp_path / result).unlink()
    assert study.main(args) == 0
    assert fake_runs[len(runs_before) :] == runs_before  # the same runs, in the same order
    assert _table((tmp_path / result).read_text()) == _table(first)


def test_ratios_are_to_the_same_algorithms_clean_mean_run(fake_runs, tmp_path):
    assert study.main(["--algorithm", "pflda", "--seeds", "0", "--rounds", "2"]) == 0
    rows = [r for r in _table((tmp_path / "robust_aggregation_pflda.md").read_text()).splitlines()[2:]]
    ratios = {r.split("|")[1].strip(): re.findall(r"\(([0-9.]+)×\)", r) for r in rows}
    assert set(ratios["pflda (mean)"]) == {"1.00"}
    for label, found in ratios.items():
        if label != "pflda (mean)":
            assert set(found) == {f"{ROBUST_LOSS / MEAN_LOSS:.2f}"}, label

"""The robust-aggregation results file names the real command, the run it compares with and
every hyperparameter (the PFL-DA file named a module that does not exist, called its mean
run "FedAvg's clean run" and left out lam).  The runs are stubbed: only the text is checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import common
from benchmarks import robust_aggregation as study


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    seen = []

    def run_one(clients, algorithm, reducer, attack, seed, rounds, n_attackers):
        seen.append((algorithm, reducer[0]))
        loss = 2.0 if reducer[0] == "mean" else 2.5
        return study.Run(reducer[0], attack, seed, loss, (loss,) * rounds)

    monkeypatch.setattr(study, "printers", lambda n, cache=True: {})
    monkeypatch.setattr(study, "run_one", run_one)
    monkeypatch.setattr(study, "plot_curves", lambda *a, **k: None)
    monkeypatch.setattr(study, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return seen


def test_pflda_results_name_the_real_command_the_mean_run_and_lam(fake_runs, tmp_path):
    assert study.main(["--algorithm", "pflda", "--seeds", "0", "--rounds", "2"]) == 0
    text = (tmp_path / "robust_aggregation_pflda.md").read_text()
    assert "Command: `python -m benchmarks.robust_aggregation --algorithm pflda --seeds 0 --rounds 2`" in text
    assert "robust_aggregation_pflda --" not in text
    assert "FedAvg" not in text and "PFL-DA's clean run with the plain mean reducer (2.000)" in text
    assert "'lam': 0.9" in text
    assert "| pflda (mean) " in text and "fedavg (mean)" not in text
    assert {a for a, _ in fake_runs} == {"pflda"}


def test_fedavg_results_keep_their_wording(fake_runs, tmp_path):
    assert study.main(["--seeds", "0", "--rounds", "2"]) == 0
    text = (tmp_path / "robust_aggregation.md").read_text()
    assert "Command: `python -m benchmarks.robust_aggregation --seeds 0 --rounds 2`" in text
    assert "ratio to FedAvg's clean run (2.000)" in text and "| fedavg (mean) " in text
    assert "lam" not in text


def test_the_command_in_the_file_runs():
    """The module the results file names exists and takes --algorithm pflda."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.robust_aggregation", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--algorithm" in out.stdout and "pflda" in out.stdout

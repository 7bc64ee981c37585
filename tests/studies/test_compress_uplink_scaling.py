"""compress_uplink's weld runs train on standardised features, as the weld study did when they were
written: under that study's default ("fleet") its splits are raw, for a fleet transform these runs
never apply, and the weld MLP fell to ~50 % accuracy (8a35259)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import compress_uplink
from cloud_aggregator.rounds import simulation


class _StopError(Exception):
    pass


def _first_clients(monkeypatch: pytest.MonkeyPatch, run) -> dict:
    seen: dict = {}

    def capture(spec, clients, *args, **kwargs):
        seen.update(clients)
        raise _StopError

    monkeypatch.setattr(simulation, "simulate", capture)
    with pytest.raises(_StopError):
        run()
    return seen


@pytest.mark.parametrize("which", ["fedavg", "ftltp"])
def test_weld_runs_train_on_standardised_features(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    if which == "fedavg":
        clients = _first_clients(monkeypatch, lambda: compress_uplink.weld_accuracy([None], [0], 1, 40))
    else:
        clients = _first_clients(monkeypatch, lambda: compress_uplink.ftltp_accuracy([None], [0], 1, 40, 30))
    x = np.concatenate([c.train.x for c in clients.values()])
    assert np.median(np.abs(x.mean(axis=0))) < 0.5
    assert 0.5 < np.median(x.std(axis=0)) < 2.0

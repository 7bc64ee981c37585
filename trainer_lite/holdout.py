"""Held-out-device testing (the IoFT talk): how the fleet's model does on a machine it never saw.

A held-out device never trains and never uploads.  Each round it takes the global (shared)
parameters, gives them the personal parts a newcomer would start from (the algorithm's
cold start on its training rows, :meth:`ClientAlgorithm.cold_start`; nothing for FedAvg) and
scores that model on its test rows.  The same function serves the ``edge-trainer`` daemon
and any simulation, so a held-out score means the same everywhere.
"""

from __future__ import annotations

from trainer_lite.algorithms.base import ClientAlgorithm, algorithm_state
from trainer_lite.client import cast_dataset, derive_rng, initial_local
from trainer_lite.data import Dataset
from trainer_lite.params import Params


def holdout_score(
    algo: ClientAlgorithm, device: str, shared: Params, train: Dataset, test: Dataset, *, phase: str
) -> dict[str, float]:
    """The fleet model's metrics on ``device``'s ``test`` rows (personal parts fitted on ``train``)."""
    dtype = algo.spec.dtype
    local = algorithm_state(initial_local(algo, device))
    if len(train):
        rng = derive_rng(algo.spec.seed, device, "holdout")
        local = algo.cold_start(shared, local, cast_dataset(train, dtype), rng=rng, phase=phase)
    scored = test if len(test) else train
    return dict(algo.evaluate(shared, local, cast_dataset(scored, dtype)))

"""A SecAgg round's sums without a broker: the survivors' weighted mean change applied to the global,
what the round engine gets from an outcome, and the in-process simulator's whole SecAgg round
(the same state machines and wire form as over MQTT, ``cloud_aggregator.serve.secagg_round``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.task_rules import secagg_config
from cloud_aggregator.rounds.types import CollectRequest, Rejection
from ioft_protocol.secagg import Abandoned, SecAggResult
from ioft_protocol.secagg.simulate import run_round
from ioft_protocol.secagg.transport import change, device_weight, flatten, unflatten
from trainer_lite.params import Params

log = logging.getLogger(__name__)
DROPPED = "secagg_dropped"
ABANDONED = "secagg_abandoned"


def replies_from(
    request: CollectRequest, ready: Mapping[str, Update], outcome: SecAggResult | Abandoned
) -> list[Update | Rejection]:
    """What the round engine gets: each survivor carrying the new global, a rejection for the others."""
    task, round_ = request.spec.name, request.round
    if isinstance(outcome, Abandoned):
        log.warning(
            "task %s round %d: SecAgg abandoned (%s): %s", task, round_, outcome.reason, outcome.detail
        )
        return [Rejection(d, f"{ABANDONED}: {outcome.reason}") for d in sorted(ready)]
    log.info(
        "task %s round %d: SecAgg sum of %d; ledger %s", task, round_, len(outcome.survivors), outcome.ledger
    )
    new = apply_mean(request.global_params, outcome)
    kept: list[Update | Rejection] = [replace(ready[d], params=new) for d in outcome.survivors]
    return kept + [Rejection(d, DROPPED) for d in sorted(set(ready) - set(outcome.survivors))]


def collect_in_process(request: CollectRequest, replies: Sequence[Any]) -> list[Any]:
    """The in-process simulator's SecAgg round: the same state machines and wire form, no broker.

    ``replies`` are admitted uploads with parameters (a simulated device has them at hand); each
    becomes its change from the global, masked and summed exactly as over MQTT.
    """
    cfg = secagg_config(request.spec)
    ready = {r.device: r for r in replies if isinstance(r, Update)}
    others = [r for r in replies if not isinstance(r, Update)]
    if cfg is None or not ready:
        return list(replies)
    run = run_round(
        cfg,
        {d: change(u.params, request.global_params) for d, u in ready.items()},
        {d: device_weight(request.spec.server, u.n_samples) for d, u in ready.items()},
        session=f"{request.spec.name}-{request.round}-{request.phase}",
        keep_view=False,
    )
    return others + replies_from(request, ready, run.outcome)


def apply_mean(global_params: Params, outcome: SecAggResult) -> Params:
    """The new global: the old one plus the survivors' weighted mean change."""
    return unflatten(flatten(global_params) + outcome.mean(), global_params)

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
from ioft_protocol import compress
from ioft_protocol.secagg import Abandoned, SecAggResult
from ioft_protocol.secagg.simulate import run_round
from ioft_protocol.secagg.transport import device_weight, flatten, secagg_input, unflatten
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
    new = apply_mean(request.global_params, outcome, request)
    kept: list[Update | Rejection] = [replace(ready[d], params=new) for d in outcome.survivors]
    return kept + [Rejection(d, DROPPED) for d in sorted(set(ready) - set(outcome.survivors))]


def collect_in_process(request: CollectRequest, replies: Sequence[Any]) -> list[Any]:
    """The in-process simulator's SecAgg round: the same state machines and wire form, no broker.

    ``replies`` are admitted uploads with parameters (a simulated device has them at hand); each
    becomes its change from the global (or, compressed, its codes: ``secagg_input``, as a device
    computes it), masked and summed exactly as over MQTT.
    """
    cfg = secagg_config(request.spec)
    ready = {r.device: r for r in replies if isinstance(r, Update)}
    others = [r for r in replies if not isinstance(r, Update)]
    if cfg is None or not ready:
        return list(replies)
    spec = request.spec
    inputs = {
        d: secagg_input(
            u.params,
            request.global_params,
            spec.secagg or {},
            spec.compress,
            task=spec.name,
            round_=request.round,
            phase=request.phase,
            device=d,
            global_hash=request.global_hash,
        )
        for d, u in ready.items()
    }
    run = run_round(
        cfg,
        inputs,
        {d: device_weight(spec.server, u.n_samples) for d, u in ready.items()},
        session=f"{spec.name}-{request.round}-{request.phase}",
        keep_view=False,
        codes=ring_codes(request),
    )
    return others + replies_from(request, ready, run.outcome)


def ring_codes(request: CollectRequest) -> int:
    """Bits of the compressed codes the round's ring carries; 0: fixed-point floats."""
    how = request.spec.compress
    return 0 if how is None else compress.CompressConfig.from_json(dict(how)).bits


def ring_length(request: CollectRequest) -> int:
    """Coordinates of the round's ring vector (the weight's not counted)."""
    size = sum(int(v.size) for v in request.global_params.values())
    how = request.spec.compress
    return size if how is None else compress.ring_length(compress.CompressConfig.from_json(dict(how)), size)


def apply_mean(global_params: Params, outcome: SecAggResult, request: CollectRequest | None = None) -> Params:
    """The new global: the old one plus the survivors' weighted mean change (with a compressed
    ``request``, decoded from the survivors' summed codes)."""
    how = None if request is None else request.spec.compress
    if how is None or request is None:
        return unflatten(flatten(global_params) + outcome.mean(), global_params)
    cfg = compress.CompressConfig.from_json(dict(how))
    clip = secagg_config(request.spec).clip  # type: ignore[union-attr]
    seed = compress.shared_seed(request.spec.name, request.round, request.phase, request.global_hash)
    size = sum(int(v.size) for v in global_params.values())
    mean = compress.decode_ring(outcome.total, int(outcome.weight), cfg, clip, seed, size)
    return unflatten(flatten(global_params) + mean, global_params)

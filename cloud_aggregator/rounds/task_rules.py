"""Which tasks each way of running a round can take: the pure checks on a task's spec and strategy
that the config runs at start-up and the round loops run again, with no round, fleet or broker in sight.
"""

from __future__ import annotations

from cloud_aggregator.aggregation.strategies import Strategy, make_strategy
from ioft_protocol.secagg import SecAggConfig
from trainer_lite.task import TaskSpec


def check_next_round(strategy: Strategy) -> None:
    """Refuse ``straggler = "next_round"`` where a late upload has no meaning.

    Raises
    ------
    ValueError
        When ``strategy`` does not declare ``accepts_late_updates`` or runs more than one phase.
    """
    if not strategy.accepts_late_updates or len(strategy.phases()) != 1:
        raise ValueError(
            f"straggler = 'next_round' needs a one-phase FedAvg-style strategy (the global is a weighted "
            f"mean of uploads, so an older upload can be shrunk and mixed in); {type(strategy).__name__} "
            f"with phases {strategy.phases()} is not one: use straggler = 'drop'"
        )


def buffered_refusal(spec: TaskSpec, strategy: Strategy) -> str | None:
    """Why ``spec`` cannot run buffered, or ``None``: the delta form needs a global that is a
    weighted mean of uploads of its own shape, one phase, and no DP or SecAgg (whose sums are per round)."""
    if not strategy.accepts_late_updates:
        return (
            f"algorithm {spec.algorithm!r} (server {strategy.name!r}) does not combine uploads as a "
            "weighted mean; buffered rounds need a fedavg-served algorithm (fedavg, pflda, fedrep ...)"
        )
    if len(strategy.phases()) != 1:
        return f"algorithm {spec.algorithm!r} has phases {list(strategy.phases())}; buffered rounds need one"
    if spec.dp is not None or spec.secagg is not None:
        return "dp and secagg account per synchronous round; run this task with mode = 'sync'"
    return None


def workers_refusal(spec: TaskSpec, straggler: str, mode: str = "sync") -> str | None:
    """Why ``spec``'s task cannot be split among workers (one line), or ``None``: it can.

    Workers fold partial sums, so only a strategy that streams every phase (the mean family,
    ``Strategy.fold``) splits; median, Krum, FedDAR-SA, FedPP, PerPCA, DP means, stragglers
    counted in the next round and SecAgg all need a round's uploads together.
    """
    if mode != "sync":
        return f"mode = {mode!r} has no rounds to split"
    if straggler != "drop":
        return "straggler = 'next_round' mixes whole late uploads into a round"
    if spec.secagg is not None:
        return "secagg sums masked uploads together"
    strategy = make_strategy(spec)
    for phase in strategy.phases():
        if strategy.fold(phase) is None:
            return f"its {strategy.name} server needs all of a round's updates at once (phase {phase!r})"
    return None


def compress_refusal(spec: TaskSpec, mode: str = "sync") -> str | None:
    """Why ``spec``'s uploads cannot be compressed (one line), or ``None``: they can.

    A compressed upload is decoded into the round's streaming mean, so every phase's server
    step must be a mean that folds (``Strategy.fold``) or, with the ``mean`` reducer, a server
    whose own means take decoded uploads (``Strategy.compressible``: FTL-TP, FedDAR); these
    compose too:

    * ``[task.dp]`` (no SecAgg): the aggregator decodes each upload first, so central mode clips
      the *decoded* change and calibrates its noise on that clip (the quantized update's own
      sensitivity); a distributed-mode device noises its change before compressing it, which
      is post-processing and costs no privacy.
    * ``[task.secagg]``: the masked ring carries the quantized integers on a grid the round
      shares (``ioft_protocol.compress.encode_ring``; its span is ``secagg.clip``), and the
      aggregator decodes the survivors' sum once.  Every device counts once there, so
      ``server.weighting`` must be ``'uniform'``.

    SecAgg with DP does not compose: the ring would sum quantized noisy changes, each device's
    with a fraction of the noise, and integer noise calibrated on the codes is not built.
    Buffered rounds (uploads quote older globals) do not either.  ``downlink`` (the global in
    2/4/8 bits, ``ioft_protocol.downlink``) composes with all of the above, but not with a server
    that personalizes what each device is sent (``Strategy.downlinks``: FTL-TP, FedPP).
    """
    if dict(spec.compress or {}).get("downlink") is not None:
        strategy = make_strategy(spec)
        if type(strategy).downlinks is not Strategy.downlinks:  # FTL-TP's groups, FedPP's propagation
            return (
                f"its {strategy.name} server sends each device a downlink of its own, which "
                "compress.downlink does not code; leave out downlink (the uplink still compresses)"
            )
    if spec.secagg is not None and spec.dp is not None:
        return (
            "[task.secagg] with [task.dp] sums quantized shares of the noise, which no calibration "
            "here covers; leave out [task.compress], or [task.secagg] (dp then composes)"
        )
    if spec.secagg is not None and dict(spec.server).get("weighting", "samples") != "uniform":
        return (
            "[task.secagg] sums codes on one grid, one count per device; set server.weighting = "
            "'uniform' or leave out [task.compress]"
        )
    if mode != "sync":
        return f"mode = {mode!r}: uploads quote older globals; compressed uplinks need mode = 'sync'"
    if spec.secagg is not None or spec.dp is not None:
        return None  # their means (the ring's, the noisy one) take the decoded changes
    strategy = make_strategy(spec)
    if strategy.compressible and dict(spec.server).get("reducer", "mean") == "mean":
        return None  # its own means (FTL-TP's groups, FedDAR's heads) take the decoded uploads
    for phase in strategy.phases():
        if strategy.fold(phase) is None:
            return (
                f"its {strategy.name} server is not a streaming mean (phase {phase!r}): compressed "
                "uploads decode into a mean; use a fedavg-served algorithm or server.reducer = 'mean'"
            )
    return None


def secagg_config(spec: TaskSpec) -> SecAggConfig | None:
    """The task's SecAgg settings, or ``None`` when it has none."""
    return None if spec.secagg is None else SecAggConfig.from_json(spec.secagg)


def check_secagg_task(spec: TaskSpec) -> None:
    """Refuse, naming what to change, a SecAgg task whose server is not a plain weighted mean."""
    if secagg_config(spec) is None:
        return
    strategy = make_strategy(spec)
    server = dict(spec.server)
    if not strategy.secagg:
        raise ValueError(
            f"task {spec.name!r}: secagg needs a mean-family algorithm (server 'fedavg'); "
            f"{spec.algorithm!r} aggregates with {strategy.name!r}"
        )
    if server.get("reducer", "mean") != "mean":
        raise ValueError(
            f"task {spec.name!r}: secagg sums updates, so server.reducer must be 'mean' (or unset)"
        )
    if server.get("weighting", "samples") not in ("samples", "uniform"):
        raise ValueError(f"task {spec.name!r}: secagg supports server.weighting 'samples' or 'uniform'")
    dp = spec.dp or {}
    if dp and (dp.get("mode") != "distributed" or server.get("weighting", "samples") != "uniform"):
        # the aggregator sees no single change to clip or weigh: only devices can add the noise
        raise ValueError(
            f"task {spec.name!r}: secagg with dp needs dp mode 'distributed' and server.weighting 'uniform'"
        )

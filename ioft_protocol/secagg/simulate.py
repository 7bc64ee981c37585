"""Run one SecAgg round in-process, every message through its wire form, with dropouts.

For tests and the cost benchmark: ``drop`` names, per stage, the devices that go silent
instead of answering it (``"keys"``: before advertising, ``"shares"``: after the key
exchange, ``"masked"``: after sharing keys, ``"unmask"``: after uploading).  ``view``
holds every payload the server received, as bytes: what an honest-but-curious
aggregator (or anyone reading the uplink topics) sees.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ioft_protocol.secagg.client import ClientSecAgg, SecAggRefusedError
from ioft_protocol.secagg.config import SecAggConfig
from ioft_protocol.secagg.messages import (
    AdvertiseKeys,
    Inbox,
    MaskedInput,
    NeighbourKeys,
    Setup,
    ShareKeys,
    UnmaskAnswer,
    UnmaskRequest,
)
from ioft_protocol.secagg.server import Abandoned, SecAggResult, ServerSecAgg


@dataclass
class RoundRun:
    outcome: SecAggResult | Abandoned
    server: ServerSecAgg
    clients: dict[str, ClientSecAgg]
    view: dict[str, dict[str, bytes]] = field(default_factory=dict)  # stage -> device -> payload
    bytes_up: dict[str, int] = field(default_factory=dict)  # device -> bytes it sent
    bytes_down: dict[str, int] = field(default_factory=dict)  # device -> bytes it received
    stage_cpu_s: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> device -> CPU s
    server_cpu_s: float = 0.0

    @property
    def device_cpu_s(self) -> dict[str, float]:
        """Each device's CPU time over the round (thread CPU of the in-process run)."""
        out: dict[str, float] = {}
        for per_device in self.stage_cpu_s.values():
            for d, s in per_device.items():
                out[d] = out.get(d, 0.0) + s
        return out


def run_round(
    config: SecAggConfig,
    updates: Mapping[str, np.ndarray],
    weights: Mapping[str, float],
    *,
    drop: Mapping[str, set[str]] | None = None,
    session: str = "r1",
    seed: int = 0,
    keep_view: bool = True,
    make_client: Callable[[str], ClientSecAgg] = ClientSecAgg,
    certificates: bool = False,
    codes: int = 0,
) -> RoundRun:
    """One round over the wire form; devices that refuse a request are counted as dropped.

    ``make_client`` builds each device's state machine (e.g. with its signing certificate);
    ``certificates``: the fleet logs in with them (an unset ``signed_keys`` then means true);
    ``codes``: the updates are compressed integer codes of that many bits (``RoundParams.codes``)."""
    drop = drop or {}
    devices = sorted(updates)
    length = int(np.asarray(updates[devices[0]]).size)
    t0 = time.thread_time()
    server = ServerSecAgg(
        config,
        devices,
        session=session,
        length=length,
        rng=random.Random(seed),
        certificates=certificates,
        codes=codes,
    )
    clients = {d: make_client(d) for d in devices}
    run = RoundRun(outcome=None, server=server, clients=clients)  # type: ignore[arg-type]
    run.bytes_up = dict.fromkeys(devices, 0)
    run.bytes_down = dict.fromkeys(devices, 0)
    server_cpu = time.thread_time() - t0

    stages = [
        ("keys", server.setup, Setup, lambda c, m: c.setup(m), server.receive_keys, AdvertiseKeys),
        (
            "shares",
            server.close_keys,
            NeighbourKeys,
            lambda c, m: c.share_keys(m),
            server.receive_shares,
            ShareKeys,
        ),
        (
            "masked",
            server.close_shares,
            Inbox,
            lambda c, m: c.masked_input(m, updates[c.device], weights[c.device]),
            server.receive_masked,
            MaskedInput,
        ),
        (
            "unmask",
            server.close_masked,
            UnmaskRequest,
            lambda c, m: c.unmask(m),
            server.receive_unmask,
            UnmaskAnswer,
        ),
    ]
    for stage, ask, req_cls, answer, receive, ans_cls in stages:
        t0 = time.thread_time()
        requests = ask()
        server_cpu += time.thread_time() - t0
        run.view[stage] = {}
        run.stage_cpu_s[stage] = {}
        for d, req in requests.items():
            wire = req.encode()
            run.bytes_down[d] += len(wire)
            if d in drop.get(stage, set()):
                continue
            t0 = time.thread_time()
            try:
                reply = answer(clients[d], req_cls.decode(wire)).encode()
            except SecAggRefusedError:
                continue
            finally:
                run.stage_cpu_s[stage][d] = time.thread_time() - t0
            run.bytes_up[d] += len(reply)
            if keep_view:
                run.view[stage][d] = reply
            t0 = time.thread_time()
            receive(d, ans_cls.decode(reply))
            server_cpu += time.thread_time() - t0
        if server.outcome is not None:
            break
    if server.outcome is None:
        t0 = time.thread_time()
        server.close_unmask()
        server_cpu += time.thread_time() - t0
    run.outcome = server.outcome  # type: ignore[assignment]
    run.server_cpu_s = server_cpu
    return run

"""``cloud-aggregator serve`` as a lying aggregator: a man in the middle of the SecAgg key exchange.

Run as ``python -m tests.e2e.secagg_liar serve --config FILE``.  It is the real ``serve``, except
for its lie, which ``IOFT_LIAR`` picks:

* ``swap`` (default): when it relays the neighbours' keys it swaps, for every device, its first
  neighbour's share-encryption key for one of its own (keeping that neighbour's certificate and
  signature): with unsigned keys, each device would seal its Shamir shares for that neighbour to
  the liar.
* ``rekey``: it runs a round's stages up to the masked inputs, then the whole round again under
  the same session id: a device that answers the session twice re-keys and sends a second
  masked input of the same update.  Each pass logs ``liar pass N: K masked inputs``.

It also waits 3 s per SecAgg stage instead of 15 (the devices that refuse go silent).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from cloud_aggregator import cli
from cloud_aggregator.rounds.secagg import ring_codes, ring_length
from cloud_aggregator.serve import secagg_round
from ioft_protocol.secagg import ServerSecAgg, crypto
from ioft_protocol.secagg.messages import NeighbourKeys
from ioft_protocol.secagg.transport import Envelope, topic_down

log = logging.getLogger("liar")
LIAR_KEY = crypto.KeyPair()
_close_keys = ServerSecAgg.close_keys
_fleet_init = secagg_round.SecAggFleet.__init__
STAGES = ("setup", "neighbour_keys", "inbox", "unmask")


def lying_close_keys(self: ServerSecAgg) -> dict[str, NeighbourKeys]:
    out = {}
    for device, msg in _close_keys(self).items():
        keys = dict(msg.keys)
        first = min(keys)
        keys[first] = [LIAR_KEY.public, *keys[first][1:]]
        out[device] = NeighbourKeys(keys)
    return out


def short_stages(self: secagg_round.SecAggFleet, inner: object, **kw: object) -> None:
    _fleet_init(self, inner, **{**kw, "stage_deadline_s": 3.0})  # type: ignore[arg-type]


def rekeying_run(self: secagg_round.SecAggFleet, request: Any, cfg: Any, devices: list[str]) -> Any:
    """Up to the masked inputs, then the whole round again, under one session id."""
    session = f"{request.spec.name}-{request.round}-{request.phase}-liar"
    _passes(self, request, cfg, devices, session, STAGES[:3], 1)
    return _passes(self, request, cfg, devices, session, STAGES, 2)


def _passes(
    fleet: secagg_round.SecAggFleet,
    request: Any,
    cfg: Any,
    devices: list[str],
    session: str,
    stages: tuple[str, ...],
    n: int,
) -> Any:
    """``stages`` of one pass, as ``SecAggFleet.run_secagg`` drives them; logs its masked inputs."""
    task = request.spec.name
    server = ServerSecAgg(
        cfg,
        devices,
        session=session,
        length=ring_length(request),
        certificates=fleet.certificates,
        codes=ring_codes(request),
    )
    masked: list[str] = []

    def receive_masked(device: str, msg: Any) -> None:
        masked.append(device)
        server.receive_masked(device, msg)

    receive = dict(
        zip(
            STAGES,
            (server.receive_keys, server.receive_shares, receive_masked, server.receive_unmask),
            strict=True,
        )
    )
    close = dict(
        zip(STAGES, (server.close_keys, server.close_shares, server.close_masked, None), strict=True)
    )
    requests: dict[str, Any] = server.setup()
    try:
        for stage in stages:
            if server.outcome is not None:
                return server.outcome
            for device, msg in requests.items():
                env = Envelope(session, request.round, request.phase, stage, msg.encode())
                fleet.inner.session.publish(
                    topic_down(fleet.inner.fleet, task, device), env.encode(), timeout=None
                )
            fleet._gather(task, session, stage, set(requests), receive[stage])
            if close[stage] is not None:
                requests = close[stage]()
        return server.outcome or server.close_unmask()
    finally:
        log.warning("liar pass %d: %d masked inputs", n, len(masked))


if os.environ.get("IOFT_LIAR", "swap") == "rekey":
    secagg_round.SecAggFleet.run_secagg = rekeying_run  # type: ignore[method-assign]
else:
    ServerSecAgg.close_keys = lying_close_keys  # type: ignore[method-assign]
secagg_round.SecAggFleet.__init__ = short_stages  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))

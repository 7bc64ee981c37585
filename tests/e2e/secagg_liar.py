"""``cloud-aggregator serve`` as a lying aggregator: a man in the middle of the SecAgg key exchange.

Run as ``python -m tests.e2e.secagg_liar serve --config FILE``.  It is the real ``serve``, except
that when it relays the neighbours' keys it swaps, for every device, its first neighbour's
share-encryption key for one of its own (keeping that neighbour's certificate and signature):
with unsigned keys, each device would seal its Shamir shares for that neighbour to the liar.
It also waits 3 s per SecAgg stage instead of 15 (the devices that refuse go silent).
"""

from __future__ import annotations

import sys

from cloud_aggregator import cli
from cloud_aggregator.serve import secagg_round
from ioft_protocol.secagg import ServerSecAgg, crypto
from ioft_protocol.secagg.messages import NeighbourKeys

LIAR_KEY = crypto.KeyPair()
_close_keys = ServerSecAgg.close_keys
_fleet_init = secagg_round.SecAggFleet.__init__


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


ServerSecAgg.close_keys = lying_close_keys  # type: ignore[method-assign]
secagg_round.SecAggFleet.__init__ = short_stages  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))

"""Secure aggregation (SecAgg+: Bell et al., CCS 2020, on Bonawitz et al., CCS 2017).

Devices mask their clipped, fixed-point update with pairwise masks that cancel in the sum
and a self-mask, and Shamir-share the seeds among their neighbours on a sparse random
graph, so the aggregator learns the sum of the survivors' updates and nothing else.

Both sides run pure state machines (no transport, no torch): :class:`ClientSecAgg` on a
device, :class:`ServerSecAgg` on the aggregator.  Four stages, each a request from the
server and an answer from every live device::

    setup         -> advertise keys   (two X25519 public keys)
    neighbour keys-> share keys       (Shamir shares of the mask key and self-mask seed,
                                        encrypted to each neighbour)
    inbox         -> masked input     (fixed-point update + self mask ± pairwise masks)
    unmask request-> unmask answer    (per neighbour: its self-mask share if it survived,
                                        its mask-key share if it dropped; never both)

Modules: ``config`` (settings and per-round parameters), ``quantize`` (fixed point in
Z/2^r), ``shamir``, ``crypto`` (X25519, HKDF, AEAD, AES-CTR masks), ``graph`` (random
Harary graph), ``messages`` (stage messages and their wire form), ``client``, ``server``.
"""

from ioft_protocol.secagg.client import ClientSecAgg, SecAggRefusedError
from ioft_protocol.secagg.config import RoundParams, SecAggConfig
from ioft_protocol.secagg.server import Abandoned, AbandonReason, SecAggResult, ServerSecAgg

__all__ = [
    "AbandonReason",
    "Abandoned",
    "ClientSecAgg",
    "RoundParams",
    "SecAggConfig",
    "SecAggRefusedError",
    "SecAggResult",
    "ServerSecAgg",
]

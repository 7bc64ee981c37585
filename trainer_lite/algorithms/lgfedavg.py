"""LG-FedAvg (Liang et al. 2020): personal local representations, a shared global head.

The mirror image of FedPer: a device trains its representation (body) and the
global head together, uploads the head and keeps the body.  ``personal_blocks``
names the blocks kept on the device; by default every block with parameters
except the last.  On PFL-DA's encoder/decoder models this is Simple-DA's
partition (personal encoder, shared decoder), as the PFL-DA paper remarks.

Cold start: FedPer's (:mod:`trainer_lite.algorithms.fedper`): the personal blocks are
fitted to the first rows through the frozen downlinked shared blocks.
"""

from __future__ import annotations

from trainer_lite.algorithms.base import register_client
from trainer_lite.algorithms.fedper import PartialSharingClient


@register_client
class LGFedAvgClient(PartialSharingClient):
    """LG-FedAvg: personal body, shared head (by default the last block with parameters)."""

    name = "lgfedavg"
    server = "fedavg"

    def default_personal_blocks(self) -> list[str]:
        return self._param_blocks()[:-1]

"""One device's admitted upload, the word every wing shares: the strategies combine these, the
streaming fold sums them, the round engine and its fleets hand them on."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer_lite.params import Params


@dataclass(frozen=True)
class Update:
    """One device's validated upload for a round and phase."""

    device: str
    params: Params
    n_samples: int
    metrics: dict[str, float] = field(default_factory=dict)

"""FedRep's server: FedAvg over the body (the only thing devices upload); heads never leave them."""

from __future__ import annotations

from cloud_aggregator.strategies.base import register_strategy
from cloud_aggregator.strategies.fedavg import FedAvg

register_strategy("fedrep")(FedAvg)

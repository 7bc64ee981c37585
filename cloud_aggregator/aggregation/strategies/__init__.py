"""Server sides of the federated algorithms; importing registers them all.

Each strategy registers under its ``name``; which strategy serves a client algorithm
is named by the client (``ClientAlgorithm.server`` in ``trainer_lite.algorithms``), and
:func:`make_strategy` follows it.
"""

from cloud_aggregator.aggregation.strategies import fedavg as _fedavg  # noqa: F401  (registers)
from cloud_aggregator.aggregation.strategies import feddar as _feddar  # noqa: F401
from cloud_aggregator.aggregation.strategies import fedpp as _fedpp  # noqa: F401
from cloud_aggregator.aggregation.strategies import ftltp as _ftltp  # noqa: F401
from cloud_aggregator.aggregation.strategies import perpca as _perpca  # noqa: F401
from cloud_aggregator.aggregation.strategies import pfedme as _pfedme  # noqa: F401
from cloud_aggregator.aggregation.strategies import separate as _separate  # noqa: F401
from cloud_aggregator.aggregation.strategies.base import (
    Strategy,
    TensorSpec,
    make_strategy,
    register_strategy,
)
from cloud_aggregator.aggregation.update import Update

__all__ = ["Strategy", "TensorSpec", "Update", "make_strategy", "register_strategy"]

"""The stable names for people who script the system: import from here, not from the modules.

The modules behind these names may move (the packages are reorganised as they grow); these
names do not.  A name is imported only when it is first used, so ``import ioft`` is cheap and a
device that takes only its own names (``ServingModel``, ``DeviceConfig``, the trainer's and the
features') never loads the cloud's modules or torch.

Groups (see ``docs/api.md``):

* the simulator: :class:`Simulation`, :class:`SimulatedFleet`, :class:`ClientData`, :func:`simulate`,
  :func:`mean_test_loss`;
* the round engine and the aggregations: :class:`RoundEngine`, :class:`MemoryStore`,
  :class:`Strategy`, :func:`make_strategy`;
* tasks, data and models: :class:`TaskSpec`, :class:`Dataset`, :func:`build_model`,
  :func:`model_names`, :class:`ClientAlgorithm`, :func:`make_client`;
* features: :class:`FeatureSchema`, :data:`DEFAULT_SCHEMA`, :func:`extract_features`,
  :func:`extract_many`, :func:`schema_hash`;
* the device: :class:`ServingModel`, :class:`DeviceConfig`.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each stable name -> the module that holds it today.
_WHERE = {
    "Simulation": "cloud_aggregator.rounds.simulation",
    "SimulatedFleet": "cloud_aggregator.rounds.simulation",
    "ClientData": "cloud_aggregator.rounds.simulation",
    "simulate": "cloud_aggregator.rounds.simulation",
    "mean_test_loss": "cloud_aggregator.rounds.simulation",
    "RoundEngine": "cloud_aggregator.rounds.engine",
    "MemoryStore": "cloud_aggregator.rounds.engine",
    "Strategy": "cloud_aggregator.aggregation.strategies",
    "make_strategy": "cloud_aggregator.aggregation.strategies",
    "TaskSpec": "trainer_lite.task",
    "Dataset": "trainer_lite.data",
    "build_model": "trainer_lite.models",
    "model_names": "trainer_lite.models",
    "ClientAlgorithm": "trainer_lite.algorithms",
    "make_client": "trainer_lite.algorithms",
    "FeatureSchema": "sensors.features",
    "DEFAULT_SCHEMA": "sensors.features",
    "extract_features": "sensors.features",
    "extract_many": "sensors.features",
    "schema_hash": "sensors.features",
    "ServingModel": "edge.serving.model",
    "DeviceConfig": "edge.config",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ioft' has no attribute {name!r}; its names: {', '.join(__all__)}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__

"""The examples in the pure pieces' docstrings run, as PyWavelets' do: an example that drifts from
the code fails here (``make test`` runs it with the rest of the suite)."""

from __future__ import annotations

import doctest
import importlib

import pytest

#: Modules whose docstrings carry examples; each must carry at least one.
WITH_EXAMPLES = (
    "sensors.features.stats",
    "cloud_aggregator.aggregation.mean",
    "ioft_protocol.quantize",
    "ioft_protocol.compress",
    "ioft_protocol.downlink",
)


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_a_modules_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0, f"{result.failed} of {name}'s examples failed (printed above)"

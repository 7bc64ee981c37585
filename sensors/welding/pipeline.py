"""Moved to :mod:`sensors.features.pipeline`: this path keeps working, with a ``DeprecationWarning``,
until version 0.2.0.

``sensors`` imports no other project package, so it cannot list the move in
:mod:`ioft_protocol.moved` as ``edge`` does; this file stands in for it.  The new module is
loaded by name so that the import graph (``lint-imports``) keeps the welding stack below the
features.
"""

import importlib
import sys
import warnings

warnings.warn(
    "sensors.welding.pipeline moved to sensors.features.pipeline; import it from there: "
    "the old path goes in version 0.2.0",
    DeprecationWarning,
    stacklevel=2,
)
# The same module object at both paths, so its classes stay one.
sys.modules[__name__] = importlib.import_module("sensors.features.pipeline")

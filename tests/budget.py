"""Hypothesis example budgets: each property test names its CI budget through :func:`examples`.

``make test`` runs the suite derandomized (profile ``ci``: the same examples every run, so a
latent failure cannot surface on an unrelated change); ``make explore`` draws fresh examples
with ``IOFT_HYPOTHESIS_SCALE`` (30) times every budget.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev")
settings.register_profile("explore", derandomize=False, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

_SCALE = max(1, int(os.environ.get("IOFT_HYPOTHESIS_SCALE", "1")))


def examples(n: int) -> int:
    """``n`` examples under CI; ``n × IOFT_HYPOTHESIS_SCALE`` when exploring."""
    return n * _SCALE

"""The aggregator's half of DP-FedAvg: a noisy, fixed-denominator mean and the task's ledger.

A mean-family strategy (``Strategy.dp_modes`` non-empty) holds a :class:`PrivateMean` when
its task sets ``dp`` and routes its means through it; the arithmetic is
``trainer_lite.privacy`` (the devices' too), ε is ``cloud_aggregator.aggregation.accountant``'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainer_lite.params import Params
from trainer_lite.privacy import DPConfig, clip_delta, noisy_mean

log = logging.getLogger(__name__)


def _ledger(sampling_rate: float, cfg: DPConfig) -> Any:
    # Lazy: dp-accounting pulls in scipy (~1.4 s); loaded only when a task uses DP, so every
    # other `cloud-aggregator` start stays as fast as it was.
    from cloud_aggregator.aggregation.accountant import PrivacyLedger

    return PrivacyLedger(sampling_rate, cfg.delta, cfg.epsilon_budget)


def dp_refusal(strategy: str, modes: tuple[str, ...], cfg: DPConfig, reducer: str = "mean") -> str | None:
    """Why ``strategy`` cannot run ``cfg`` (one line), or ``None``."""
    if not modes:
        return (
            f"differential privacy (dp) needs a mean-family strategy (fedavg, ftltp); "
            f"this algorithm's server is {strategy!r}"
        )
    if cfg.mode not in modes:
        return f"dp mode {cfg.mode!r} is not supported by the {strategy} server; use one of {list(modes)}"
    if reducer != "mean":
        return f"dp needs reducer 'mean' (clipping plus noise replace robust rules), got {reducer!r}"
    return None


class PrivateMean:
    """Noise, clipping and accounting for one DP task's server.

    Parameters
    ----------
    cfg
        The task's ``DPConfig``.
    sampling_rate
        The accountant's ``q`` (each device's chance to be in a round).
    rng
        Draws the central noise; ``None``: OS entropy (a seeded draw could be subtracted by
        anyone who knows the seed).  Simulations pass a seeded one to be reproducible.
    """

    def __init__(self, cfg: DPConfig, sampling_rate: float, rng: np.random.Generator | None = None) -> None:
        self.cfg = cfg
        self.ledger = _ledger(sampling_rate, cfg)
        self.rng = rng or np.random.default_rng()

    @property
    def central(self) -> bool:
        return self.cfg.mode == "central"

    def clip_jointly(self, reference: Mapping[str, np.ndarray], uploads: Sequence[Params]) -> list[Params]:
        """Each upload as ``g + clip(θ − g)`` over all its tensors (central mode; distributed uploads
        carry noise and pass unchanged), before a strategy splits them into several means."""
        if not self.central:
            return list(uploads)
        out = []
        for params in uploads:
            delta = {
                n: np.asarray(v, np.float64) - np.asarray(reference[n], np.float64) for n, v in params.items()
            }
            clipped, _ = clip_delta(delta, self.cfg.clip)
            out.append({n: np.asarray(reference[n], np.float64) + d for n, d in clipped.items()})
        return out

    def mean(
        self,
        reference: Mapping[str, np.ndarray],
        uploads: Sequence[Mapping[str, np.ndarray]],
        denominator: float,
        *,
        clipped: bool = False,
    ) -> Params:
        """``g + (Σ clip(θ_k − g) + noise) / denominator``; ``clipped``: uploads went through
        :meth:`clip_jointly` already."""
        return noisy_mean(
            reference,
            uploads,
            denominator=denominator,
            noise_std=self.cfg.noise_std if self.central else 0.0,
            rng=self.rng,
            clip=self.cfg.clip if self.central and not clipped else None,
        )

    def release(self, task: str, round_: int, summed: int, expected: int) -> float:
        """Account one completed round whose sum held ``summed`` uploads of ``expected``; returns ε."""
        z = self.cfg.noise_multiplier
        if not self.central:  # the sum holds only the noise shares of those who came
            z *= math.sqrt(summed / expected)
        eps = self.ledger.spend(z)
        log.info(
            "task %s round %d: ε = %.3f at δ = %g after %d DP rounds (z = %.3g, q = %.3g%s)",
            task,
            round_,
            eps,
            self.cfg.delta,
            len(self.ledger.multipliers),
            z,
            self.ledger.sampling_rate,
            "" if self.cfg.epsilon_budget is None else f", budget {self.cfg.epsilon_budget:g}",
        )
        return eps

    def stop_reason(self) -> str | None:
        """Why the next round must not run (it would pass the ε budget); ``None``: within it."""
        return self.ledger.stop_reason(self.cfg.noise_multiplier)

    def summary(self) -> dict[str, Any]:
        """ε so far and the settings it holds for; ``stop`` says why no further round may run."""
        out = {"mode": self.cfg.mode, **self.ledger.summary()}
        why = self.stop_reason()
        if why is not None:
            out["stop"] = why
        return out

    def state(self) -> dict[str, Any]:
        return {"multipliers": self.ledger.state()}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.ledger.load_state(state.get("multipliers", []))

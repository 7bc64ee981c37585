"""DP-FedAvg's arithmetic (McMahan et al., ICLR 2018), the one copy devices and the aggregator share.

A task with ``TaskSpec.dp`` set bounds what any one device can move the global by:

* **On the device**, the shared update's change ``Δ = θ − g`` from the round's downlink ``g``
  is clipped to L2 norm ``C`` over all its tensors jointly (:func:`privatize_upload`), so a
  device's whole contribution to the sum has sensitivity ``C``.
* **On the sum**, Gaussian noise of standard deviation ``σ = z·C`` (``z`` the noise
  multiplier).  ``central``: the aggregator draws it (:func:`noisy_mean`), so it must be
  trusted with the clipped updates.  ``distributed``: each of the ``n`` expected devices
  adds ``N(0, σ²/n)`` to its own clipped change before upload, so the sum of ``n`` uploads
  carries ``N(0, σ²)`` and, under secure aggregation, nobody sees an update with less noise
  than the sum.
* The mean divides by the **fixed** expected count (the paper's ``qW`` with every
  ``w_k = 1``), not by how many came: the denominator must not depend on who took part.

Every device counts once whatever its sample count (the paper's flat estimator): a weight
proportional to samples would let one device's influence exceed ``C``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trainer_lite.params import Params

DP_MODES = ("central", "distributed")


@dataclass(frozen=True)
class DPConfig:
    """A task's differential-privacy settings (``[task.dp]`` in the aggregator's TOML).

    Attributes
    ----------
    mode
        ``"central"`` (the aggregator adds the noise) or ``"distributed"`` (each device adds
        its share; with secure aggregation no party needs to be trusted).
    clip
        ``C``: the L2 bound on one device's shared change per round.
    noise_multiplier
        ``z``: the noise on the sum has standard deviation ``z·C``.
    delta
        The δ at which ε is reported (well below 1 / fleet size).
    epsilon_budget
        The task stops before a round that would take ε past it; ``None``: never.
    devices_per_round
        The fixed denominator of the mean, and the ``n`` a device divides the variance by in
        distributed mode.  Strategies that count their own (FTL-TP) leave it unset.
    fleet_size
        How many devices each round's are drawn from at random; ``devices_per_round /
        fleet_size`` is the accountant's sampling rate.  ``None``: every device every round
        (rate 1).  Only where a secret random draw really happens (the simulator's
        ``participation``): ``serve`` takes every selected device and refuses it.
    """

    mode: str = "central"
    clip: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    epsilon_budget: float | None = None
    devices_per_round: int | None = None
    fleet_size: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in DP_MODES:
            raise ValueError(f"dp mode must be one of {DP_MODES}, got {self.mode!r}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"dp clip must be a finite number > 0, got {self.clip}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ValueError(f"dp noise_multiplier must be a finite number > 0, got {self.noise_multiplier}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"dp delta must lie in (0, 1), got {self.delta}")
        if self.epsilon_budget is not None and not self.epsilon_budget > 0:
            raise ValueError(f"dp epsilon_budget must be > 0, got {self.epsilon_budget}")
        for name in ("devices_per_round", "fleet_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"dp {name} must be an integer >= 1, got {value!r}")
        if self.fleet_size is not None and self.devices_per_round is None:
            raise ValueError("dp fleet_size needs devices_per_round (the sampling rate is their ratio)")
        if self.fleet_size is not None and self.fleet_size < (self.devices_per_round or 1):
            raise ValueError(
                f"dp fleet_size {self.fleet_size} is below devices_per_round {self.devices_per_round}"
            )
        if self.mode == "distributed" and self.devices_per_round is None:
            raise ValueError(
                "dp mode 'distributed' needs devices_per_round: each device adds 1/n of the noise variance"
            )

    @property
    def noise_std(self) -> float:
        """``σ = z·C``: the standard deviation of the noise on the sum."""
        return self.noise_multiplier * self.clip

    def device_noise_std(self) -> float:
        """What one device adds in distributed mode (``σ/√n``); 0 in central mode."""
        if self.mode != "distributed":
            return 0.0
        assert self.devices_per_round is not None  # checked in __post_init__
        return self.noise_std / math.sqrt(self.devices_per_round)

    def sampling_rate(self) -> float:
        """``devices_per_round / fleet_size`` (1 without a fleet size)."""
        if self.fleet_size is None or self.devices_per_round is None:
            return 1.0
        return self.devices_per_round / self.fleet_size

    def to_spec(self) -> dict[str, Any]:
        """The JSON-able form ``TaskSpec.dp`` carries (unset fields left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_spec(cls, raw: Mapping[str, Any] | None) -> DPConfig | None:
        """Read ``TaskSpec.dp``; ``None`` stays ``None``; unknown keys are refused by name."""
        if raw is None:
            return None
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown dp fields {unknown}; valid: {sorted(known)}")
        return cls(**raw)


def l2_norm(params: Mapping[str, np.ndarray]) -> float:
    """The L2 norm over every tensor of ``params`` jointly (float64)."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(v, dtype=np.float64)))) for v in params.values()))


def clip_delta(delta: Mapping[str, np.ndarray], clip: float) -> tuple[Params, float]:
    """``delta · min(1, C/‖delta‖)`` in float64, and the norm before clipping."""
    norm = l2_norm(delta)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {n: np.asarray(v, dtype=np.float64) * scale for n, v in delta.items()}, norm


def _delta(reference: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray]) -> Params:
    missing = sorted(set(params) - set(reference))
    if missing:
        raise ValueError(
            f"dp: uploaded tensors {missing} are not in the round's downlink; cannot clip a change"
        )
    return {
        n: np.asarray(v, dtype=np.float64) - np.asarray(reference[n], dtype=np.float64)
        for n, v in params.items()
    }


def privatize_upload(
    reference: Mapping[str, np.ndarray],
    upload: Mapping[str, np.ndarray],
    cfg: DPConfig,
    rng: np.random.Generator,
) -> Params:
    """The device's side: ``g + clip(θ − g)``, plus its noise share in distributed mode.

    ``rng`` must be secret (OS entropy on a device): noise anyone can regenerate protects nothing.
    Returns tensors in ``upload``'s dtypes.
    """
    clipped, _ = clip_delta(_delta(reference, upload), cfg.clip)
    std = cfg.device_noise_std()
    out: Params = {}
    for n, d in clipped.items():
        if std > 0:
            d = d + rng.normal(0.0, std, size=d.shape)
        ref = np.asarray(reference[n], dtype=np.float64)
        out[n] = (ref + d).astype(np.asarray(upload[n]).dtype)
    return out


def noisy_mean(
    reference: Mapping[str, np.ndarray],
    uploads: Sequence[Mapping[str, np.ndarray]],
    *,
    denominator: float,
    noise_std: float,
    rng: np.random.Generator,
    clip: float | None = None,
) -> Params:
    """The aggregator's side: ``g + (Σ_k clip(θ_k − g) + N(0, noise_std²)) / denominator``.

    Parameters
    ----------
    reference
        The round's global ``g`` (at least the uploads' names).
    uploads
        What devices sent (their names are the result's; every upload has the same names).
    denominator
        The fixed expected count (never how many came).
    noise_std
        ``z·C`` in central mode; 0 in distributed mode (the uploads carry it).
    clip
        Re-clip each change on the server (central mode: the server sees them); ``None``
        for uploads that carry noise or were clipped jointly already.

    Returns tensors in the reference's dtypes.
    """
    if not uploads:
        raise ValueError("nothing to aggregate: no updates")
    if not denominator > 0:
        raise ValueError(f"dp denominator must be > 0, got {denominator}")
    names = sorted(uploads[0])
    total = {n: np.zeros(np.shape(reference[n]), dtype=np.float64) for n in names}
    for i, params in enumerate(uploads):
        if sorted(params) != names:
            raise ValueError(f"update {i} has names {sorted(params)}, expected {names}")
        delta = _delta(reference, params)
        if clip is not None:
            delta, _ = clip_delta(delta, clip)
        for n in names:
            total[n] += delta[n]
    out: Params = {}
    for n in names:
        noise = rng.normal(0.0, noise_std, size=total[n].shape) if noise_std > 0 else 0.0
        ref = np.asarray(reference[n])
        out[n] = (ref.astype(np.float64) + (total[n] + noise) / denominator).astype(ref.dtype)
    return out

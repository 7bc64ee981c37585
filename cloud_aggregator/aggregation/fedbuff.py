"""FedBuff's server step (Nguyen et al., AISTATS 2022, Algorithm 1): a buffer of staleness-weighted deltas.

Devices train continuously, each from the global version it last pulled.  Every admitted
upload ``θ_i`` becomes a delta ``Δ_i = θ_i − g_{v_i}`` from the version ``v_i`` it started
from, with staleness ``τ_i = version − v_i`` (server updates applied since that pull).  The
buffer sums ``s(τ_i)·Δ_i``; at the ``k``-th arrival it applies

    ``g ← g + η_g · (Σ s(τ_i)·Δ_i) / k``

(the paper divides by ``K``, not by the weights' sum), bumps :attr:`UpdateBuffer.version` and
empties.  ``s(τ) = 1/√(1+τ)`` is the paper's staleness weight (``"sqrt"``); ``"constant"``
weighs every delta 1.  An upload older than ``max_staleness`` versions is dropped, never summed.

With ``k`` = the number of devices, ``η_g = 1`` and no staleness this is the synchronous
uniform mean (FedAvg with ``weighting = "uniform"``): ``g + mean(θ_i − g) = mean(θ_i)``.

Pure arithmetic over name-keyed arrays: no transport, no admission, no clock.  Which version
a device pulled, and which uploads pass admission, is :mod:`cloud_aggregator.rounds.buffered`'s job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from trainer_lite.params import Params, copy_params

#: Staleness weightings ``s(τ)``, by name.
STALENESS = ("sqrt", "constant")


def staleness_weight(tau: int, kind: str = "sqrt") -> float:
    """``s(τ)``: ``1/√(1+τ)`` (``"sqrt"``, the paper's) or ``1`` (``"constant"``)."""
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + tau)
    if kind == "constant":
        return 1.0
    raise ValueError(f"staleness must be one of {list(STALENESS)}, got {kind!r}")


@dataclass(frozen=True)
class BufferConfig:
    """FedBuff's server settings.

    Parameters
    ----------
    k
        Admitted arrivals per server update (the paper's K).
    server_lr
        η_g, the step along the buffer's mean delta.
    staleness
        ``s(τ)``, one of :data:`STALENESS`.
    max_staleness
        Uploads more than this many versions old are dropped; ``None``: none is.
    """

    k: int = 10
    server_lr: float = 1.0
    staleness: str = "sqrt"
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"buffer_k must be >= 1, got {self.k}")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")
        if self.staleness not in STALENESS:
            raise ValueError(f"staleness must be one of {list(STALENESS)}, got {self.staleness!r}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")


@dataclass(frozen=True)
class Arrival:
    """What the buffer did with one upload."""

    staleness: int
    #: ``s(τ)``; 0 for a dropped upload.
    weight: float
    #: Dropped: older than ``max_staleness``.
    dropped: bool
    #: This arrival filled the buffer and the global moved to :attr:`version`.
    applied: bool
    version: int


class UpdateBuffer:
    """The global, its version counter and the buffer of weighted deltas (module docstring).

    Parameters
    ----------
    global_params
        Version 0 of the global (copied; the caller's arrays are never touched).
    config
        ``k``, ``η_g``, ``s(τ)`` and ``max_staleness``.
    """

    def __init__(self, global_params: Mapping[str, np.ndarray], config: BufferConfig | None = None) -> None:
        self.config = config or BufferConfig()
        self.dropped = 0
        self.restart_at(global_params, 0)

    def restart_at(self, global_params: Mapping[str, np.ndarray], version: int) -> None:
        """Continue from a stored ``version`` of the global (an aggregator restart): the buffer empty."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self.global_params: Params = copy_params(global_params)
        self.version = version
        #: Uploads summed since the last server update.
        self.count = 0
        self._sum: dict[str, np.ndarray] = {
            n: np.zeros(np.shape(v), dtype=np.float64) for n, v in self.global_params.items()
        }

    def add(
        self, params: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], base_version: int
    ) -> Arrival:
        """Buffer the upload ``params`` of a device that started from version ``base_version``
        (parameters ``base``); apply the buffer when it holds ``k`` uploads.

        Raises ``ValueError`` (the buffer unchanged) when names or shapes differ from the
        global's, or when ``base_version`` is not a version this buffer has had.
        """
        if not 0 <= base_version <= self.version:
            raise ValueError(f"base version {base_version} is not in 0..{self.version}")
        for name, ref in self._sum.items():
            if name not in params or name not in base:
                raise ValueError(f"upload or base lacks {name!r}; the global has {sorted(self._sum)}")
            if np.shape(params[name]) != ref.shape or np.shape(base[name]) != ref.shape:
                raise ValueError(f"{name!r} has shape {np.shape(params[name])}, expected {ref.shape}")
        if set(params) != set(self._sum):
            raise ValueError(f"upload names {sorted(params)} differ from the global's {sorted(self._sum)}")
        cfg = self.config
        tau = self.version - base_version
        if cfg.max_staleness is not None and tau > cfg.max_staleness:
            self.dropped += 1
            return Arrival(tau, 0.0, dropped=True, applied=False, version=self.version)
        weight = staleness_weight(tau, cfg.staleness)
        for name, acc in self._sum.items():
            delta = np.asarray(params[name], dtype=np.float64) - np.asarray(base[name], dtype=np.float64)
            acc += weight * delta
        self.count += 1
        applied = self.count == cfg.k
        if applied:
            self._apply()
        return Arrival(tau, weight, dropped=False, applied=applied, version=self.version)

    def _apply(self) -> None:
        """``g ← g + η_g · sum / k``, in float64, cast back to each tensor's dtype; empty the buffer."""
        step = self.config.server_lr / self.config.k
        out: Params = {}
        for name, value in self.global_params.items():
            moved = np.asarray(value, dtype=np.float64) + step * self._sum[name]
            out[name] = moved.astype(np.asarray(value).dtype)
            self._sum[name] = np.zeros_like(self._sum[name])
        self.global_params = out  # a new dict: whoever holds the old version keeps it intact
        self.version += 1
        self.count = 0

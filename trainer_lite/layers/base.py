"""The layer protocol and small numeric helpers shared by every layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from trainer_lite.params import Params

Cache = Any


class Layer(ABC):
    """A differentiable map ``x -> y`` with learnable parameters in a ``Params`` dict.

    A layer holds hyperparameters only; its learnable state lives in the ``Params``
    dict the caller passes in, so the same layer object serves every client.
    """

    @abstractmethod
    def init(self, rng: np.random.Generator) -> Params:
        """Fresh parameters drawn from ``rng``."""

    @abstractmethod
    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        """Output and the cache ``backward`` needs."""

    @abstractmethod
    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        """Parameter gradients and input gradient for upstream gradient ``dy``."""

    def input_width(self) -> int | None:
        """Input features per row this layer takes; ``None`` when any width will do."""
        return None

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        """Parameter gradients only.

        Containers call this on their first trainable layer, where the input
        gradient is never used; layers override it when skipping ``dx`` saves work.
        """
        return self.backward(p, cache, dy)[0]

    def param_names(self) -> list[str]:
        """The names ``init`` returns, in the same order.

        The default draws a throwaway initialisation; layers override it cheaply.
        """
        return list(self.init(np.random.default_rng(0)))

    def __call__(self, p: Params, x: np.ndarray) -> np.ndarray:
        return self.forward(p, x)[0]


def uniform(rng: np.random.Generator, bound: float, shape: tuple[int, ...]) -> np.ndarray:
    """U(-bound, bound) of ``shape`` (float64)."""
    return rng.uniform(-bound, bound, size=shape)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Numerically stable logistic function, keeping float32 inputs float32.

    ``exp(-|x|)`` never overflows, and ``e / (1 + e)`` keeps full relative
    precision for very negative inputs, where ``1 - sigmoid(-x)`` would cancel.
    """
    x = np.asarray(x)
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    e = np.exp(-np.abs(x))
    r = 1.0 / (1.0 + e)
    return np.where(x >= 0, r, e * r)


def check_features(x: np.ndarray, d_in: int, layer: str) -> None:
    """Raise ``ValueError`` unless ``x`` is a 2-D batch with ``d_in`` features."""
    if x.ndim != 2 or x.shape[1] != d_in:
        raise ValueError(
            f"{layer} expects input of shape (batch, {d_in}), got {x.shape}; reshape x to 2-D "
            f"(e.g. x.reshape(-1, {d_in}))"
        )

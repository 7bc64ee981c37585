"""Layers with explicit forward and backward passes over named parameters.

A layer holds hyperparameters only; its learnable state lives in a ``Params`` dict
that the caller passes in.  ``forward`` returns the output and a cache;
``backward`` takes the cache and the upstream gradient and returns the parameter
gradients (same names) and the gradient with respect to the input.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainer_lite.params import Params

Cache = Any


class Layer(ABC):
    """A differentiable map ``x -> y`` with learnable parameters in a ``Params`` dict."""

    @abstractmethod
    def init(self, rng: np.random.Generator) -> Params:
        """Fresh parameters drawn from ``rng``."""

    @abstractmethod
    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        """Output and the cache ``backward`` needs."""

    @abstractmethod
    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        """Parameter gradients and input gradient for upstream gradient ``dy``."""

    def __call__(self, p: Params, x: np.ndarray) -> np.ndarray:
        return self.forward(p, x)[0]


def _uniform(rng: np.random.Generator, bound: float, shape: tuple[int, ...]) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape)


class Linear(Layer):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(d_in, d_out)``.

    ``init="torch"`` draws U(-1/sqrt(d_in), 1/sqrt(d_in)) for both, as
    ``torch.nn.Linear`` does; ``init="kaiming"`` draws the weight from
    N(0, 2/d_in) (Kaiming-normal, fan-in, ReLU) and zeroes the bias.
    """

    def __init__(self, d_in: int, d_out: int, *, bias: bool = True, init: str = "torch") -> None:
        if d_in < 1 or d_out < 1:
            raise ValueError(f"Linear needs positive sizes, got d_in={d_in}, d_out={d_out}")
        if init not in ("torch", "kaiming", "zeros"):
            raise ValueError(f"unknown init {init!r}; choose 'torch', 'kaiming' or 'zeros'")
        self.d_in, self.d_out, self.bias, self.init_scheme = d_in, d_out, bias, init

    def init(self, rng: np.random.Generator) -> Params:
        shape = (self.d_in, self.d_out)
        if self.init_scheme == "kaiming":
            p = {"weight": rng.normal(0.0, np.sqrt(2.0 / self.d_in), size=shape)}
            if self.bias:
                p["bias"] = np.zeros(self.d_out)
            return p
        if self.init_scheme == "zeros":
            p = {"weight": np.zeros(shape)}
            if self.bias:
                p["bias"] = np.zeros(self.d_out)
            return p
        bound = 1.0 / np.sqrt(self.d_in)
        p = {"weight": _uniform(rng, bound, shape)}
        if self.bias:
            p["bias"] = _uniform(rng, bound, (self.d_out,))
        return p

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        y = x @ p["weight"]
        if self.bias:
            y = y + p["bias"]
        return y, x

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        x = cache
        grads = {"weight": x.T @ dy}
        if self.bias:
            grads["bias"] = dy.sum(axis=0)
        return grads, dy @ p["weight"].T


class Affine(Layer):
    """PFL-DA's linear encoder ``Φ(x) = φ1 ⊙ x + φ2``, elementwise per feature.

    With one feature this is Table 4's ``φ1·x + φ2``; the authors' code draws both
    from U(-1, 1) (``torch.nn.Linear(1, 1)``'s default).
    """

    def __init__(self, dim: int = 1) -> None:
        if dim < 1:
            raise ValueError(f"Affine needs dim >= 1, got {dim}")
        self.dim = dim

    def init(self, rng: np.random.Generator) -> Params:
        return {"scale": rng.uniform(-1.0, 1.0, self.dim), "shift": rng.uniform(-1.0, 1.0, self.dim)}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        return x * p["scale"] + p["shift"], x

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        x = cache
        return {"scale": (dy * x).sum(axis=0), "shift": dy.sum(axis=0)}, dy * p["scale"]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Numerically stable logistic function."""
    out = np.empty_like(x, dtype=np.result_type(x, np.float32))
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


class SigmoidGLM(Layer):
    """Sigmoid decoder of PFL-DA Table 4: ``y = sigmoid(h) @ weight + bias``.

    With one feature and one output this is ``g1·σ(h) + g2``; the authors'
    code is ``Linear(1, 1)(sigmoid(h))``, so ``weight`` and ``bias`` start U(-1, 1).
    """

    def __init__(self, d_in: int = 1, d_out: int = 1) -> None:
        self.linear = Linear(d_in, d_out)

    def init(self, rng: np.random.Generator) -> Params:
        return self.linear.init(rng)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        s = sigmoid(x)
        y, lin_cache = self.linear.forward(p, s)
        return y, (s, lin_cache)

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        s, lin_cache = cache
        grads, ds = self.linear.backward(p, lin_cache, dy)
        return grads, ds * s * (1.0 - s)


class ReLU(Layer):
    """``max(x, 0)``; no parameters."""

    def init(self, rng: np.random.Generator) -> Params:
        return {}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        mask = x > 0
        return x * mask, mask

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        return {}, dy * cache


class Sequential(Layer):
    """Named layers applied in order; parameter names are ``"<layer>.<param>"``."""

    def __init__(self, layers: Sequence[tuple[str, Layer]]) -> None:
        names = [n for n, _ in layers]
        if len(set(names)) != len(names) or any("." in n for n in names):
            raise ValueError(f"layer names must be unique and dot-free, got {names}")
        self.layers = list(layers)

    def init(self, rng: np.random.Generator) -> Params:
        out: Params = {}
        for name, layer in self.layers:
            for k, v in layer.init(rng).items():
                out[f"{name}.{k}"] = v
        return out

    def _sub(self, p: Params, name: str) -> Params:
        head = name + "."
        return {k[len(head) :]: v for k, v in p.items() if k.startswith(head)}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        caches = []
        for name, layer in self.layers:
            x, c = layer.forward(self._sub(p, name), x)
            caches.append(c)
        return x, caches

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        grads: Params = {}
        for (name, layer), c in zip(reversed(self.layers), reversed(cache), strict=True):
            g, dy = layer.backward(self._sub(p, name), c, dy)
            for k, v in g.items():
                grads[f"{name}.{k}"] = v
        return grads, dy

    def names(self, layer: str) -> list[str]:
        """The parameter names that belong to the named sub-layer."""
        return [f"{layer}.{k}" for k in dict(self.layers)[layer].init(np.random.default_rng(0))]

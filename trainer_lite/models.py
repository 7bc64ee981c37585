"""Model builders by name, so a task spec (plain JSON) can say which model a fleet trains.

Every model is a ``Sequential`` of named blocks (``encoder``, ``decoder``, ``head``...);
algorithms declare which blocks are shared by these names.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from trainer_lite.layers import Affine, Layer, Linear, ReLU, Sequential, SigmoidGLM

ModelBuilder = Callable[..., Sequential]
_MODELS: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator adding a builder to the registry under ``name``."""

    def deco(fn: ModelBuilder) -> ModelBuilder:
        if name in _MODELS:
            raise ValueError(f"model {name!r} registered twice")
        _MODELS[name] = fn
        return fn

    return deco


def build_model(name: str, **kwargs: Any) -> Sequential:
    """Build the named model; the error lists the valid names."""
    try:
        builder = _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(_MODELS)}") from None
    return builder(**kwargs)


def model_names() -> list[str]:
    return sorted(_MODELS)


def mlp(sizes: list[int], *, init: str = "torch", final_relu: bool = False) -> Sequential:
    """Linear/ReLU stack ``sizes[0] -> ... -> sizes[-1]`` with layers ``fc0, relu0, fc1, ...``."""
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least input and output sizes, got {sizes}")
    layers: list[tuple[str, Layer]] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append((f"fc{i}", Linear(a, b, init=init)))
        if i < len(sizes) - 2 or final_relu:
            layers.append((f"relu{i}", ReLU()))
    return Sequential(layers)


@register_model("sigmoid_glm")
def sigmoid_glm(dim: int = 1) -> Sequential:
    """PFL-DA Table 4, first row: encoder ``φ1·x + φ2``, decoder ``g1·σ(h) + g2``."""
    return Sequential([("encoder", Affine(dim)), ("decoder", SigmoidGLM(dim, 1))])


@register_model("linear")
def linear(d_in: int = 1, d_out: int = 1) -> Sequential:
    """A single linear block named ``head``."""
    return Sequential([("head", Linear(d_in, d_out))])

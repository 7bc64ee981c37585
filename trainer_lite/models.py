"""Every model a device and the aggregator can build, by the name a task spec (plain JSON) uses.

Every model is a ``Sequential`` of named blocks (``encoder``, ``decoder``, ``head``...);
algorithms declare which blocks are shared by these names.  :data:`_MODELS` at the
end of this module is the one list of them, the models the algorithms need
(``vector`` for ``echo``, ``linear_rep`` for FedDAR) included.  A study that trains a
model of its own adds it with :func:`register_model` from its own module
(``benchmarks.study_models``); a task spec over MQTT only ever names models listed here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from trainer_lite.layers import (
    Affine,
    GaussianGLM,
    Layer,
    Linear,
    ReLU,
    Residual,
    Sequential,
    SigmoidGLM,
    Vector,
)

ModelBuilder = Callable[..., Sequential]


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator adding a builder outside this module (a study's model) under ``name``.

    Raises
    ------
    ValueError
        If ``name`` is already taken.
    """

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
    """The names :func:`build_model` accepts, sorted."""
    return sorted(_MODELS)


def mlp(sizes: list[int], *, init: str = "torch", final_relu: bool = False) -> Sequential:
    """Linear/ReLU stack ``sizes[0] -> ... -> sizes[-1]`` with layers ``fc0, relu0, fc1, ...``.

    Parameters
    ----------
    sizes
        Widths from input to output, e.g. FTL-TP's ``[624, 175, 125, 50, 4]``.
    init
        Passed to every :class:`~trainer_lite.layers.Linear`: ``"torch"`` (torch's
        default), ``"kaiming"`` (Kaiming-normal weights, zero biases, as FTL-TP) or
        ``"zeros"``.
    final_relu
        Also apply a ReLU after the last linear map.
    """
    sizes = list(sizes)
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least input and output sizes, got {sizes}")
    if any(not isinstance(s, int | np.integer) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ValueError(f"MLP sizes must be positive integers, got {sizes}")
    layers: list[tuple[str, Layer]] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append((f"fc{i}", Linear(int(a), int(b), init=init)))
        if i < len(sizes) - 2 or final_relu:
            layers.append((f"relu{i}", ReLU()))
    return Sequential(layers)


def mlp_model(sizes: list[int], init: str = "torch", final_relu: bool = False) -> Sequential:
    """:func:`mlp` under the registry (FTL-TP: ``sizes=[624, 175, 125, 50, C]``, ``init="kaiming"``)."""
    return mlp(sizes, init=init, final_relu=final_relu)


def sigmoid_glm(dim: int = 1) -> Sequential:
    """PFL-DA Table 4, first row: encoder ``φ1·x + φ2``, decoder ``g1·σ(h) + g2``."""
    return Sequential([("encoder", Affine(dim)), ("decoder", SigmoidGLM(dim, 1))])


def linear(d_in: int = 1, d_out: int = 1) -> Sequential:
    """A single linear block named ``head``."""
    return Sequential([("head", Linear(d_in, d_out))])


def gaussian_glm(
    dim: int = 1, n_basis: int = 16, form: str = "code", hidden: int | None = None, bias: bool | None = None
) -> Sequential:
    """PFL-DA Table 4, second row: encoder ``φ1·x + φ2``, Gaussian-basis decoder.

    The default is the authors' code (``Encoder_kernel`` + ``Decoder_kernel``): 16
    centres U(0, 1), ``stds`` 1 in ``exp(-(μ − x)²·0.5·s²)``, then linear maps
    16 → 1024 → 1 with nothing between.  ``form="paper"`` gives Table 4's
    ``Σ_k w_k exp(-(x − μ_k)²/(2σ_k²))`` (one linear map, no bias, unless
    ``hidden``/``bias`` say otherwise).  Parameters: ``encoder.scale``,
    ``encoder.shift``, ``decoder.rbf.centers``, ``decoder.rbf.stds`` (code) or
    ``decoder.rbf.widths`` (paper), ``decoder.fc1.*``/``decoder.fc2.*`` (hidden) or
    ``decoder.fc.*``.
    """
    if hidden is None:
        hidden = 1024 if form == "code" else 0
    decoder = GaussianGLM(n_basis, dim, 1, form=form, hidden=hidden, bias=bias)
    return Sequential([("encoder", Affine(dim)), ("decoder", decoder)])


def printer_nn(
    dim: int = 1, feature_dim: int = 128, encoder_hidden: int = 64, width: int = 128, depth: int = 5
) -> Sequential:
    """PFL-DA Table 4, third row, as the authors' code builds it (``space='nn'``).

    Encoder: ``Linear(dim, feature_dim)(x) + MLP dim → encoder_hidden → ReLU →
    feature_dim`` (their ``Encoder``).  Decoder: ``depth`` linear maps of width
    ``width`` with ReLU between (their ``Decoder``: 128 → 128 ×4 → 1).
    Parameters: ``encoder.body.fc0.*``, ``encoder.body.fc1.*``,
    ``encoder.shortcut.*``, ``decoder.fc0.*`` … ``decoder.fc{depth-1}.*``.  Their
    training also adds ``0.01·MSE(mean feature, 0)`` on the encoder output; that
    belongs to the algorithm, not the model.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    encoder = Residual(mlp([dim, encoder_hidden, feature_dim]), shortcut=Linear(dim, feature_dim))
    decoder = mlp([feature_dim] + [width] * (depth - 1) + [1])
    return Sequential([("encoder", encoder), ("decoder", decoder)])


def linear_representation(
    d_in: int = 20, k: int = 2, d_out: int = 1, bias: bool = False, init: str = "torch"
) -> Sequential:
    """FedDAR's linear model ``y = xᵀ B w``: block ``encoder`` (``d_in → k``), block ``head`` (``k → d_out``)."""
    return Sequential(
        [
            ("encoder", Linear(d_in, k, bias=bias, init=init)),
            ("head", Linear(k, d_out, bias=bias, init=init)),
        ]
    )


def vector(size: int = 1000) -> Sequential:
    """The ``echo`` transport benchmark's model: one parameter vector, block ``v``."""
    return Sequential([("v", Vector(size))])


#: Every model a device and the aggregator can build, by the name a task spec uses.
_MODELS: dict[str, ModelBuilder] = {
    "mlp": mlp_model,
    "sigmoid_glm": sigmoid_glm,
    "linear": linear,
    "gaussian_glm": gaussian_glm,
    "printer_nn": printer_nn,
    "linear_rep": linear_representation,
    "vector": vector,
}

"""Layers with explicit forward and backward passes over named parameters.

A layer holds hyperparameters only; its learnable state lives in a ``Params`` dict
that the caller passes in.  ``forward`` returns the output and a cache;
``backward`` takes the cache and the upstream gradient and returns the parameter
gradients (same names) and the gradient with respect to the input.

Modules: ``base`` (the protocol), ``basic`` (linear maps, sigmoid GLM, ReLU,
a bare parameter vector),
``gaussian`` (PFL-DA's Gaussian-basis GLM), ``containers`` (``Sequential``,
``Residual``).
"""

from trainer_lite.layers.base import Cache, Layer, sigmoid
from trainer_lite.layers.basic import Affine, Linear, ReLU, SigmoidGLM, Vector
from trainer_lite.layers.containers import Residual, Sequential
from trainer_lite.layers.gaussian import GaussianBasis, GaussianGLM

__all__ = [
    "Affine",
    "Cache",
    "GaussianBasis",
    "GaussianGLM",
    "Layer",
    "Linear",
    "ReLU",
    "Residual",
    "Sequential",
    "SigmoidGLM",
    "Vector",
    "sigmoid",
]

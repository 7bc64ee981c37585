"""The models the PFL-DA studies train, and the stacked loss they train with.

``benchmarks.pflda_sine`` and ``benchmarks.pflda_printers`` run fleets *stacked*:
clients (or seed replicas) of the same data shape share one array with a leading
member axis.  The layers here work on such arrays and initialise exactly as
:mod:`trainer_lite.layers` does, so a stacked model starts where the per-client
model would.  No task spec over MQTT names these models, so they are not in
:mod:`trainer_lite.models`; a study that needs them calls :func:`register_study_models`,
which adds them (and the loss ``"stacked_mse"``) to trainer_lite's registries.

Models: ``pflda_sine`` (PFL-DA §4.1), ``printer_sigmoid_stacked``,
``printer_gaussian_stacked`` and ``printer_nn_stacked`` (Table 4, stacked).
"""

from __future__ import annotations

import functools

import numpy as np

from trainer_lite.algorithms.base import register_loss
from trainer_lite.layers import Affine, Cache, GaussianGLM, Layer, Linear, ReLU, Residual, Sequential, sigmoid
from trainer_lite.models import register_model
from trainer_lite.params import Params

# ---------------------------------------------------------------------------
# Stacked building blocks and loss.
# ---------------------------------------------------------------------------


def _t(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, -1, -2)


def sum_samples(a: np.ndarray) -> np.ndarray:
    """``a.sum(axis=-2, keepdims=True)`` as a batched GEMV: NumPy's strided reduction over the
    middle axis of a ``(members, n, d)`` array is an order of magnitude slower."""
    return np.ones((*a.shape[:-2], 1, a.shape[-2]), dtype=a.dtype) @ a


class StackLinear(Layer):
    """``Linear`` over ``(..., n, d_in)`` inputs with one weight ``(..., d_in, d_out)`` per leading index.

    Initialises exactly as :class:`trainer_lite.layers.Linear` (same draws, same
    names), so a stacked model starts where the per-client model would.
    """

    def __init__(self, d_in: int, d_out: int, *, init: str = "torch") -> None:
        self.proto = Linear(d_in, d_out, init=init)
        self.d_in = d_in

    def param_names(self) -> list[str]:
        return ["weight", "bias"]

    def init(self, rng: np.random.Generator) -> Params:
        return self.proto.init(rng)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        # A width-1 input is a broadcast product, far cheaper than a batched GEMM.
        y = x * p["weight"] if self.d_in == 1 else x @ p["weight"]
        y += p["bias"][..., None, :]
        return y, x

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        return {"weight": _t(cache) @ dy, "bias": sum_samples(dy)[..., 0, :]}

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        w = p["weight"]
        # A width-1 output makes dx an outer product: broadcast, not a batched GEMM.
        dx = dy * _t(w) if w.shape[-1] == 1 else dy @ _t(w)
        return self.param_grads(p, cache, dy), dx


def stacked_mse(pred: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """Sum over leading axes of each stack member's MSE; on 2-D input exactly ``losses.mse``.

    The gradient is each member's own MSE gradient, so Adam, weight decay and the
    pulls see per-client values as in a per-client run.
    """
    if pred.shape != target.shape:
        raise ValueError(f"prediction shape {pred.shape} != target shape {target.shape}")
    diff = pred - target
    per = np.mean(diff * diff, axis=(-2, -1))
    return float(np.sum(per)), diff * (2.0 / (diff.shape[-1] * diff.shape[-2]))


# ---------------------------------------------------------------------------
# The sine study's model.
# ---------------------------------------------------------------------------


class PhaseEncoder(Layer):
    """``Φ_β(x) = Π(x + NN_β(1))``, ``Π(φ) = φ mod 1 − ½``: a learned phase shift.

    ``NN`` is the authors' ``Embeddingnet1`` on the constant input 1: a shortcut
    ``Linear(1, 1)`` plus ``Linear(1, h)``, ReLU, ``Linear(h, h)``, ReLU, ``Linear(h, 1)``.
    Parameters ``body.fc{0,1,2}.*`` and ``shortcut.*``.
    """

    def __init__(self, hidden: int = 32) -> None:
        body = Sequential(
            [
                ("fc0", StackLinear(1, hidden)),
                ("relu0", ReLU()),
                ("fc1", StackLinear(hidden, hidden)),
                ("relu1", ReLU()),
                ("fc2", StackLinear(hidden, 1)),
            ]
        )
        self.net = Residual(body, shortcut=StackLinear(1, 1))

    def param_names(self) -> list[str]:
        return self.net.param_names()

    def init(self, rng: np.random.Generator) -> Params:
        return self.net.init(rng)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        one = np.ones((*x.shape[:-2], 1, 1), dtype=x.dtype)
        shift, cache = self.net.forward(p, one)
        return np.mod(x + shift, 1.0) - 0.5, cache

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        # Π has slope 1 almost everywhere, so the shift's gradient is the sum over points.
        return self.net.param_grads(p, cache, sum_samples(dy))

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        return self.param_grads(p, cache, dy), dy


def sine_decoder(width: int = 32) -> Sequential:
    """The authors' ``DecoderFunction``: ``fc1`` + ReLU, three ``relu(fc(h)) + h`` blocks, ``fc5``."""
    layers: list[tuple[str, Layer]] = [("fc1", StackLinear(1, width)), ("relu1", ReLU())]
    for i in (2, 3, 4):
        block = Sequential([("fc", StackLinear(width, width)), ("relu", ReLU())])
        layers.append((f"res{i}", Residual(block)))
    layers.append(("fc5", StackLinear(width, 1)))
    return Sequential(layers)


def pflda_sine_model(width: int = 32, encoder_hidden: int = 32) -> Sequential:
    """PFL-DA §4.1's model (blocks ``encoder`` and ``decoder``); runs per client or stacked."""
    return Sequential([("encoder", PhaseEncoder(encoder_hidden)), ("decoder", sine_decoder(width))])


# ---------------------------------------------------------------------------
# The three models of Table 4, able to run stacked (one parameter set per replica).
# They draw and name their parameters exactly as trainer_lite's ``sigmoid_glm``,
# ``gaussian_glm`` and ``printer_nn``; the study test checks outputs and gradients agree.
# ---------------------------------------------------------------------------


def _col(v: np.ndarray) -> np.ndarray:
    """A per-member row vector ``(..., d)`` as ``(..., 1, d)``, to broadcast over samples."""
    return v[..., None, :]


class StackAffine(Layer):
    """:class:`trainer_lite.layers.Affine` (``φ1·x + φ2``) over stacked inputs."""

    def __init__(self, dim: int = 1) -> None:
        self.proto = Affine(dim)

    def param_names(self) -> list[str]:
        return ["scale", "shift"]

    def init(self, rng: np.random.Generator) -> Params:
        return self.proto.init(rng)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        return x * _col(p["scale"]) + _col(p["shift"]), x

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        return {"scale": (dy * cache).sum(axis=-2), "shift": dy.sum(axis=-2)}

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        return self.param_grads(p, cache, dy), dy * _col(p["scale"])


class StackSigmoidGLM(Layer):
    """:class:`trainer_lite.layers.SigmoidGLM` (``g1·σ(h) + g2``) over stacked inputs."""

    def __init__(self) -> None:
        self.linear = StackLinear(1, 1)

    def param_names(self) -> list[str]:
        return ["weight", "bias"]

    def init(self, rng: np.random.Generator) -> Params:
        return self.linear.init(rng)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        s = sigmoid(x)
        y, _ = self.linear.forward(p, s)
        return y, s

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        return self.linear.param_grads(p, cache, dy)

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        s = cache
        return self.param_grads(p, s, dy), (dy @ np.swapaxes(p["weight"], -1, -2)) * s * (1.0 - s)


class FusedGaussianDecoder(Layer):
    """The authors' Gaussian decoder (``gaussian_glm``'s, form ``"code"``) computed through ``W1·W2``.

    ``y = fc2(fc1(φ(x)))`` with nothing between the two linear maps, so
    ``y = φ·(W1 W2) + (b1 W2 + b2)`` and every gradient factors the same way
    (e.g. ``∂W1 = (φᵀ dy) W2ᵀ``): the 16 → 1024 → 1 map costs O(16·1024) a step
    instead of O(n·16·1024), with the very same parameters and training dynamics.
    """

    def __init__(self, n_basis: int = 16, hidden: int = 1024) -> None:
        self.proto = GaussianGLM(n_basis, 1, 1, form="code", hidden=hidden)

    def param_names(self) -> list[str]:
        return self.proto.param_names()

    def init(self, rng: np.random.Generator) -> Params:
        return self.proto.init(rng)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        a = p["rbf.stds"] ** 2  # the code form: s multiplies, a = s²
        d = x - p["rbf.centers"]  # (..., n, 1) − (..., 1, K)
        phi = np.exp(-0.5 * a * d * d)
        w1, w2 = p["fc1.weight"], p["fc2.weight"]
        v = w1 @ w2
        c0 = _col(p["fc1.bias"]) @ w2 + _col(p["fc2.bias"])
        return phi @ v + c0, (d, phi, a, v)

    def _grads(self, p: Params, cache: Cache, dy: np.ndarray, need_dx: bool):
        d, phi, a, v = cache
        t = lambda m: np.swapaxes(m, -1, -2)  # noqa: E731
        w1, w2 = p["fc1.weight"], p["fc2.weight"]
        gsum = dy.sum(axis=-2, keepdims=True)  # (..., 1, 1)
        phig = t(phi) @ dy  # (..., K, 1)
        grads = {
            "fc1.weight": phig @ t(w2),
            "fc1.bias": (gsum @ t(w2))[..., 0, :],
            "fc2.weight": t(w1) @ phig + t(_col(p["fc1.bias"])) * gsum,
            "fc2.bias": gsum[..., 0, :],
        }
        # Through the bumps: g = dL/dφ·φ, ∂μ = g·d·a, ∂a = −½·g·d², a = s² so ∂s = 2s·∂a.
        g = (dy @ t(v)) * phi
        gd = g * d
        gda = gd * a
        grads["rbf.centers"] = gda.sum(axis=-2, keepdims=True)
        grads["rbf.stds"] = -0.5 * (gd * d).sum(axis=-2, keepdims=True) * 2.0 * p["rbf.stds"]
        dx = -gda.sum(axis=-1, keepdims=True) if need_dx else None
        return grads, dx

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        return self._grads(p, cache, dy, False)[0]

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        return self._grads(p, cache, dy, True)


def printer_sigmoid_stacked() -> Sequential:
    """``sigmoid_glm`` (one feature) for stacked fleets."""
    return Sequential([("encoder", StackAffine(1)), ("decoder", StackSigmoidGLM())])


def printer_gaussian_stacked(n_basis: int = 16, hidden: int = 1024) -> Sequential:
    """``gaussian_glm`` (the authors' form) for stacked fleets, fused as above."""
    return Sequential([("encoder", StackAffine(1)), ("decoder", FusedGaussianDecoder(n_basis, hidden))])


def printer_nn_stacked(
    feature_dim: int = 128, encoder_hidden: int = 64, width: int = 128, depth: int = 5
) -> Sequential:
    """``printer_nn`` (the authors' NN) for stacked fleets."""
    body = Sequential(
        [
            ("fc0", StackLinear(1, encoder_hidden)),
            ("relu0", ReLU()),
            ("fc1", StackLinear(encoder_hidden, feature_dim)),
        ]
    )
    encoder = Residual(body, shortcut=StackLinear(1, feature_dim))
    sizes = [feature_dim] + [width] * (depth - 1) + [1]
    layers: list[tuple[str, Layer]] = []
    for i in range(depth):
        layers.append((f"fc{i}", StackLinear(sizes[i], sizes[i + 1])))
        if i < depth - 1:
            layers.append((f"relu{i}", ReLU()))
    return Sequential([("encoder", encoder), ("decoder", Sequential(layers))])


# ---------------------------------------------------------------------------
# Registration.
# ---------------------------------------------------------------------------


@functools.cache
def register_study_models() -> None:
    """Add the study models and ``"stacked_mse"`` to trainer_lite's registries (once per process).

    Called by each study that builds a task spec naming them
    (``benchmarks.pflda_sine``, ``benchmarks.pflda_printers``); calling it again is a no-op.
    """
    register_loss("stacked_mse", stacked_mse)
    register_model("pflda_sine")(pflda_sine_model)
    register_model("printer_sigmoid_stacked")(printer_sigmoid_stacked)
    register_model("printer_gaussian_stacked")(printer_gaussian_stacked)
    register_model("printer_nn_stacked")(printer_nn_stacked)

"""Linear maps, pointwise nonlinearities and the transport benchmark's bare parameter vector."""

from __future__ import annotations

import numpy as np

from trainer_lite.layers.base import Cache, Layer, check_features, sigmoid, uniform
from trainer_lite.params import Params

_LINEAR_INITS = ("torch", "kaiming", "zeros")


class Linear(Layer):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(d_in, d_out)``.

    Parameters
    ----------
    d_in, d_out
        Input and output widths.
    bias
        Whether to learn a bias.
    init
        ``"torch"`` draws U(-1/sqrt(d_in), 1/sqrt(d_in)) for both, as
        ``torch.nn.Linear`` does; ``"kaiming"`` draws the weight from N(0, 2/d_in)
        (``torch.nn.init.kaiming_normal_``: fan-in, ReLU gain, as FTL-TP) and zeroes
        the bias; ``"zeros"`` zeroes both.

    Notes
    -----
    The weight is stored ``(d_in, d_out)``, the transpose of torch's ``(out, in)``,
    so the forward pass is one C-contiguous GEMM with no transposed copy.
    """

    def __init__(self, d_in: int, d_out: int, *, bias: bool = True, init: str = "torch") -> None:
        if d_in < 1 or d_out < 1:
            raise ValueError(f"Linear needs positive sizes, got d_in={d_in}, d_out={d_out}")
        if init not in _LINEAR_INITS:
            raise ValueError(f"unknown init {init!r}; choose one of {list(_LINEAR_INITS)}")
        self.d_in, self.d_out, self.bias, self.init_scheme = d_in, d_out, bias, init

    def param_names(self) -> list[str]:
        return ["weight", "bias"] if self.bias else ["weight"]

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
        p = {"weight": uniform(rng, bound, shape)}
        if self.bias:
            p["bias"] = uniform(rng, bound, (self.d_out,))
        return p

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        if x.ndim != 2 or x.shape[1] != self.d_in:
            check_features(x, self.d_in, "Linear")
        if self.d_in == 1:
            # One input feature: the GEMM is an outer product, which BLAS runs as a slow K = 1 GEMM.
            # A broadcast multiply gives its bits: BLAS adds the product to a zeroed output, and
            # ``+ 0.0`` (folded into the bias) turns a -0.0 product into +0.0 as that addition does.
            y = x * p["weight"]
            y += p["bias"] + 0.0 if self.bias else 0.0
            return y, x
        y = x @ p["weight"]
        if self.bias:
            # In place on the fresh GEMM output: one pass, no temporary.
            y += p["bias"]
        return y, x

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        x = cache
        if self.bias:
            return {"weight": x.T @ dy, "bias": dy.sum(axis=0)}
        return {"weight": x.T @ dy}

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        if self.d_out == 1 and dy.ndim == 2:
            # One output: ``dy @ weight.T`` is an outer product (see ``forward``); same bits, several times faster.
            dx = dy * p["weight"].T
            dx += 0.0
            return self.param_grads(p, cache, dy), dx
        return self.param_grads(p, cache, dy), dy @ p["weight"].T

    def input_width(self) -> int | None:
        return self.d_in


class Affine(Layer):
    """PFL-DA's linear encoder ``Φ(x) = φ1 ⊙ x + φ2``, elementwise per feature.

    With one feature this is Table 4's ``φ1·x + φ2``; the authors' code draws both
    from U(-1, 1) (``torch.nn.Linear(1, 1)``'s default), and so does ``init``.
    """

    def __init__(self, dim: int = 1) -> None:
        if dim < 1:
            raise ValueError(f"Affine needs dim >= 1, got {dim}")
        self.dim = dim

    def param_names(self) -> list[str]:
        return ["scale", "shift"]

    def init(self, rng: np.random.Generator) -> Params:
        return {"scale": rng.uniform(-1.0, 1.0, self.dim), "shift": rng.uniform(-1.0, 1.0, self.dim)}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        if x.ndim != 2 or x.shape[1] != self.dim:
            check_features(x, self.dim, "Affine")
        y = x * p["scale"]
        y += p["shift"]
        return y, x

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        x = cache
        return {"scale": (dy * x).sum(axis=0), "shift": dy.sum(axis=0)}

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        return self.param_grads(p, cache, dy), dy * p["scale"]

    def input_width(self) -> int | None:
        return self.dim


class SigmoidGLM(Layer):
    """Sigmoid decoder of PFL-DA Table 4: ``y = sigmoid(h) @ weight + bias``.

    With one feature and one output this is ``g1·σ(h) + g2``; the authors'
    code is ``Linear(1, 1)(sigmoid(h))``, so ``weight`` and ``bias`` start U(-1, 1).
    """

    def __init__(self, d_in: int = 1, d_out: int = 1) -> None:
        self.linear = Linear(d_in, d_out)

    def param_names(self) -> list[str]:
        return self.linear.param_names()

    def init(self, rng: np.random.Generator) -> Params:
        return self.linear.init(rng)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        s = sigmoid(x)
        y, lin_cache = self.linear.forward(p, s)
        return y, (s, lin_cache)

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        return self.linear.param_grads(p, cache[1], dy)

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        s, lin_cache = cache
        grads, ds = self.linear.backward(p, lin_cache, dy)
        # σ' = σ(1 − σ), formed in place on the fresh ds.
        ds *= s
        ds *= 1.0 - s
        return grads, ds

    def input_width(self) -> int | None:
        return self.linear.input_width()


class ReLU(Layer):
    """``max(x, 0)``; no parameters."""

    def param_names(self) -> list[str]:
        return []

    def init(self, rng: np.random.Generator) -> Params:
        return {}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        mask = x > 0
        return np.multiply(x, mask, dtype=x.dtype), mask

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        return {}, np.multiply(dy, cache, dtype=dy.dtype)


class Vector(Layer):
    """A parameter vector ``value`` of ``size`` values that leaves its input untouched.

    The model of the zero-compute ``echo`` algorithm, where only the vector's
    transport matters; its gradient is always zero.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size

    def init(self, rng: np.random.Generator) -> Params:
        return {"value": rng.normal(size=self.size)}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        return x, None

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        return {"value": np.zeros_like(p["value"])}, dy

"""Linear's outer-product paths (one input feature forward, one output backward) give BLAS's bits.

A one-feature input layer (``printer_nn``'s encoder) and a one-output last layer (the Gaussian GLM's
``fc2``, ``printer_nn``'s decoder) make ``x @ W`` and ``dy @ W.T`` outer products; Linear computes them
by broadcasting instead of a K = 1 GEMM.  Training results must not move by one bit, so each is
compared byte for byte with the GEMM it replaces, signed zeros included.
"""

from __future__ import annotations

import numpy as np
import pytest

from trainer_lite.layers import Linear

SHAPES = [(1, 1), (3, 5), (14, 64), (42, 128), (154, 1024), (2048, 1024), (7, 1)]


def _with_zeros(a: np.ndarray) -> np.ndarray:
    """``a`` with some entries set to +0.0 and -0.0 and some tiny enough to underflow in a product."""
    flat = a.reshape(-1)
    flat[::7] = 0.0
    flat[3::11] = -0.0
    flat[5::13] = -1e-200
    flat[6::17] = 1e-200
    return a


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("rows", "d_out"), SHAPES)
def test_one_feature_forward_is_the_gemm(rows: int, d_out: int, bias: bool, dtype: type) -> None:
    rng = np.random.default_rng([rows, d_out])
    layer = Linear(1, d_out, bias=bias)
    p = {k: _with_zeros(v.astype(dtype)) for k, v in layer.init(rng).items()}
    if bias:
        p["bias"][1::3] = -0.0
    x = _with_zeros(rng.standard_normal((rows, 1)).astype(dtype))
    want = x @ p["weight"]
    if bias:
        want += p["bias"]
    got, cache = layer.forward(p, x)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    assert cache is x


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("rows", "d_in"), SHAPES)
def test_one_output_input_gradient_is_the_gemm(rows: int, d_in: int, dtype: type) -> None:
    rng = np.random.default_rng([rows, d_in, 1])
    layer = Linear(d_in, 1)
    p = {k: _with_zeros(v.astype(dtype)) for k, v in layer.init(rng).items()}
    x = rng.standard_normal((rows, d_in)).astype(dtype)
    dy = _with_zeros(rng.standard_normal((rows, 1)).astype(dtype))
    grads, dx = layer.backward(p, x, dy)
    want = dy @ p["weight"].T
    assert dx.dtype == want.dtype
    assert dx.tobytes() == want.tobytes()
    assert grads["weight"].tobytes() == (x.T @ dy).tobytes()
    assert grads["bias"].tobytes() == dy.sum(axis=0).tobytes()

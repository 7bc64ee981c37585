"""Layers and models against torch autograd (float64, relative error <= 1e-6), plus naming and dtypes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.budget import examples
from trainer_lite.layers import (
    Affine,
    GaussianBasis,
    GaussianGLM,
    Layer,
    Linear,
    ReLU,
    Residual,
    Sequential,
    SigmoidGLM,
)
from trainer_lite.models import build_model, mlp

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

RTOL = 1e-6
FAST = settings(max_examples=examples(25), deadline=None)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours − ref| / max |ref| (absolute when ref is all zeros)."""
    ref = np.asarray(ref, dtype=np.float64)
    scale = max(float(np.max(np.abs(ref), initial=0.0)), 1e-300)
    return float(np.max(np.abs(np.asarray(ours, dtype=np.float64) - ref), initial=0.0)) / scale


def check_against_torch(
    layer: Layer, torch_fn, params: dict, x: np.ndarray, rng: np.random.Generator
) -> None:
    """Forward output, every parameter gradient and the input gradient vs torch autograd."""
    y, cache = layer.forward(params, x)
    dy = rng.normal(size=y.shape)
    grads, dx = layer.backward(params, cache, dy)
    tp = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ty = torch_fn(tp, tx)
    ty.backward(torch.tensor(dy))
    assert y.shape == tuple(ty.shape)
    assert rel_err(y, ty.detach().numpy()) <= RTOL
    assert rel_err(dx, tx.grad.numpy()) <= RTOL
    assert sorted(grads) == sorted(params)
    for k in params:
        assert grads[k].shape == params[k].shape, k
        assert rel_err(grads[k], tp[k].grad.numpy()) <= RTOL, k
    # param_grads must equal the gradients of backward, without the input gradient.
    pg = layer.param_grads(params, cache, dy)
    for k in params:
        np.testing.assert_array_equal(pg[k], grads[k])


# -- torch references, written from the formulas ------------------------------------------
def t_linear(p, x, prefix=""):
    y = x @ p[prefix + "weight"]
    return y + p[prefix + "bias"] if prefix + "bias" in p else y


def t_mlp(p, x, n_linear, prefix=""):
    for i in range(n_linear):
        x = t_linear(p, x, f"{prefix}fc{i}.")
        if i < n_linear - 1:
            x = torch.relu(x)
    return x


def t_gauss_paper(c, w, x):
    d = x[:, :, None] - c
    return torch.exp(-(d**2) / (2 * w**2)).reshape(len(x), -1)


def t_gauss_code(c, s, x):
    # The PFL-DA authors' kernel: exp(-(mu - x)^2 * 0.5 * s^2).
    return torch.exp(-((c - x[:, :, None]) ** 2) * (0.5 * s**2)).reshape(len(x), -1)


dims = st.integers(1, 5)
batches = st.integers(1, 9)
seeds = st.integers(0, 2**31 - 1)


@FAST
@given(
    b=batches,
    d_in=dims,
    d_out=dims,
    bias=st.booleans(),
    init=st.sampled_from(["torch", "kaiming"]),
    seed=seeds,
)
def test_linear(b, d_in, d_out, bias, init, seed):
    rng = np.random.default_rng(seed)
    layer = Linear(d_in, d_out, bias=bias, init=init)
    params = layer.init(rng)
    if bias:  # kaiming zeroes the bias; make it nonzero so its gradient path is exercised
        params["bias"] = rng.normal(size=d_out)
    check_against_torch(layer, t_linear, params, rng.normal(size=(b, d_in)), rng)


@FAST
@given(b=batches, dim=dims, seed=seeds)
def test_affine(b, dim, seed):
    rng = np.random.default_rng(seed)
    layer = Affine(dim)
    check_against_torch(
        layer, lambda p, x: x * p["scale"] + p["shift"], layer.init(rng), rng.normal(size=(b, dim)), rng
    )


@FAST
@given(b=batches, d_in=dims, d_out=dims, seed=seeds)
def test_sigmoid_glm(b, d_in, d_out, seed):
    rng = np.random.default_rng(seed)
    layer = SigmoidGLM(d_in, d_out)
    x = rng.normal(scale=4.0, size=(b, d_in))
    check_against_torch(
        layer, lambda p, x: torch.sigmoid(x) @ p["weight"] + p["bias"], layer.init(rng), x, rng
    )


def test_sigmoid_extremes_are_finite_and_accurate():
    layer = SigmoidGLM(1, 1)
    p = {"weight": np.ones((1, 1)), "bias": np.zeros(1)}
    x = np.array([[-800.0], [-30.0], [0.0], [30.0], [800.0]])
    y, cache = layer.forward(p, x)
    ref = torch.sigmoid(torch.tensor(x)).numpy()
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, ref, rtol=1e-12)  # relative, so sigmoid(-30) ≈ 9e-14 is exact too
    _, dx = layer.backward(p, cache, np.ones_like(y))
    assert np.all(np.isfinite(dx))


@FAST
@given(b=batches, d=dims, seed=seeds)
def test_relu(b, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, d))
    check_against_torch(ReLU(), lambda p, x: torch.relu(x), {}, x, rng)


@FAST
@given(
    b=batches,
    d_in=st.integers(1, 3),
    k=st.integers(1, 6),
    form=st.sampled_from(["paper", "code"]),
    seed=seeds,
)
def test_gaussian_basis(b, d_in, k, form, seed):
    rng = np.random.default_rng(seed)
    layer = GaussianBasis(k, d_in, form=form)
    width_name = "widths" if form == "paper" else "stds"
    params = {"centers": rng.uniform(-1, 1, (d_in, k)), width_name: rng.uniform(0.5, 2.0, (d_in, k))}
    ref = t_gauss_paper if form == "paper" else t_gauss_code
    x = rng.normal(size=(b, d_in))
    check_against_torch(layer, lambda p, x: ref(p["centers"], p[width_name], x), params, x, rng)


def test_gaussian_forms_agree_at_unit_width_and_differ_after():
    rng = np.random.default_rng(0)
    paper, code = GaussianBasis(8, form="paper"), GaussianBasis(8, form="code")
    pp, pc = paper.init(np.random.default_rng(1)), code.init(np.random.default_rng(1))
    np.testing.assert_array_equal(pp["centers"], pc["centers"])
    x = rng.normal(size=(5, 1))
    np.testing.assert_allclose(paper(pp, x), code(pc, x), rtol=1e-14)
    pp["widths"] = pp["widths"] * 2.0
    pc["stds"] = pc["stds"] * 2.0
    assert not np.allclose(paper(pp, x), code(pc, x))


@FAST
@given(
    b=batches,
    k=st.integers(1, 6),
    hidden=st.sampled_from([0, 3]),
    form=st.sampled_from(["paper", "code"]),
    seed=seeds,
)
def test_gaussian_glm(b, k, hidden, form, seed):
    rng = np.random.default_rng(seed)
    layer = GaussianGLM(k, form=form, hidden=hidden)
    params = layer.init(rng)
    wn = "rbf.widths" if form == "paper" else "rbf.stds"
    params[wn] = rng.uniform(0.5, 2.0, params[wn].shape)
    basis = t_gauss_paper if form == "paper" else t_gauss_code

    def ref(p, x):
        phi = basis(p["rbf.centers"], p[wn], x)
        if hidden:
            return t_linear(p, t_linear(p, phi, "fc1."), "fc2.")  # no nonlinearity between
        return phi @ p["fc.weight"]  # Σ_k w_k φ_k, no bias

    check_against_torch(layer, ref, params, rng.normal(size=(b, 1)), rng)


@FAST
@given(b=batches, d_in=dims, width=dims, identity=st.booleans(), seed=seeds)
def test_residual(b, d_in, width, identity, seed):
    rng = np.random.default_rng(seed)
    d_out = d_in if identity else width
    body = mlp([d_in, width, d_out])
    layer = Residual(body, None if identity else Linear(d_in, d_out))
    params = layer.init(rng)

    def ref(p, x):
        y = t_mlp(p, x, 2, "body.")
        return y + (x if identity else t_linear(p, x, "shortcut."))

    check_against_torch(layer, ref, params, rng.normal(size=(b, d_in)), rng)


def test_identity_residual_rejects_width_change():
    layer = Residual(Linear(2, 3))
    with pytest.raises(ValueError, match="shortcut"):
        layer.forward(layer.init(np.random.default_rng(0)), np.ones((4, 2)))


# -- whole models ------------------------------------------------------------------------
def t_sigmoid_glm(p, x):
    h = x * p["encoder.scale"] + p["encoder.shift"]
    return torch.sigmoid(h) @ p["decoder.weight"] + p["decoder.bias"]


def t_gaussian_glm_code(p, x):
    h = x * p["encoder.scale"] + p["encoder.shift"]
    phi = t_gauss_code(p["decoder.rbf.centers"], p["decoder.rbf.stds"], h)
    return t_linear(p, t_linear(p, phi, "decoder.fc1."), "decoder.fc2.")


def t_gaussian_glm_paper(p, x):
    h = x * p["encoder.scale"] + p["encoder.shift"]
    return t_gauss_paper(p["decoder.rbf.centers"], p["decoder.rbf.widths"], h) @ p["decoder.fc.weight"]


def t_printer_nn(p, x):
    # The authors' NN: encoder sc(x) + MLP(x) into 128 features, decoder 5 linears with ReLU between.
    h = t_linear(p, x, "encoder.shortcut.") + t_mlp(p, x, 2, "encoder.body.")
    return t_mlp(p, h, 5, "decoder.")


@pytest.mark.parametrize(
    ("name", "kwargs", "ref"),
    [
        ("sigmoid_glm", {}, t_sigmoid_glm),
        ("gaussian_glm", {}, t_gaussian_glm_code),
        ("gaussian_glm", {"form": "paper"}, t_gaussian_glm_paper),
        ("printer_nn", {}, t_printer_nn),
    ],
)
@pytest.mark.parametrize("batch", [1, 14])
def test_printer_models_match_torch(name, kwargs, ref, batch):
    rng = np.random.default_rng(batch)
    model = build_model(name, **kwargs)
    x = rng.uniform(0.2, 2.2, size=(batch, 1))
    check_against_torch(model, ref, model.init(rng), x, rng)


@FAST
@given(sizes=st.lists(st.integers(1, 12), min_size=2, max_size=5), b=batches, seed=seeds)
def test_mlp_matches_torch(sizes, b, seed):
    rng = np.random.default_rng(seed)
    model = mlp(sizes, init="kaiming")
    params = {k: v + rng.normal(scale=0.1, size=v.shape) for k, v in model.init(rng).items()}
    check_against_torch(
        model, lambda p, x: t_mlp(p, x, len(sizes) - 1), params, rng.normal(size=(b, sizes[0])), rng
    )


def test_ftl_tp_mlp_at_full_size():
    rng = np.random.default_rng(3)
    model = mlp([624, 175, 125, 50, 4], init="kaiming")
    check_against_torch(model, lambda p, x: t_mlp(p, x, 4), model.init(rng), rng.normal(size=(8, 624)), rng)


# -- structure, naming, init -------------------------------------------------------------
def test_printer_model_layouts():
    g = build_model("gaussian_glm")
    shapes = {k: v.shape for k, v in g.init(np.random.default_rng(0)).items()}
    assert shapes == {
        "encoder.scale": (1,),
        "encoder.shift": (1,),
        "decoder.rbf.centers": (1, 16),
        "decoder.rbf.stds": (1, 16),
        "decoder.fc1.weight": (16, 1024),
        "decoder.fc1.bias": (1024,),
        "decoder.fc2.weight": (1024, 1),
        "decoder.fc2.bias": (1,),
    }
    p = g.init(np.random.default_rng(0))
    assert np.all((p["decoder.rbf.centers"] >= 0) & (p["decoder.rbf.centers"] < 1))
    np.testing.assert_array_equal(p["decoder.rbf.stds"], 1.0)
    nn = build_model("printer_nn")
    shapes = {k: v.shape for k, v in nn.init(np.random.default_rng(0)).items()}
    assert shapes["encoder.shortcut.weight"] == (1, 128)
    assert shapes["encoder.body.fc0.weight"] == (1, 64)
    assert shapes["encoder.body.fc1.weight"] == (64, 128)
    assert [shapes[f"decoder.fc{i}.weight"] for i in range(5)] == [(128, 128)] * 4 + [(128, 1)]
    for model in (g, nn, build_model("sigmoid_glm")):
        assert [n for n, _ in model.layers] == ["encoder", "decoder"]
        assert set(model.names("encoder")) | set(model.names("decoder")) == set(model.param_names())


def test_sequential_naming():
    inner = Sequential([("fc", Linear(2, 3)), ("act", ReLU())])
    model = Sequential([("encoder", inner), ("head", Linear(3, 1, bias=False))])
    params = model.init(np.random.default_rng(0))
    assert list(params) == ["encoder.fc.weight", "encoder.fc.bias", "head.weight"]
    assert model.param_names() == list(params)
    assert model.names("encoder") == ["encoder.fc.weight", "encoder.fc.bias"]
    assert model.names("head") == ["head.weight"]
    with pytest.raises(KeyError, match="layers are"):
        model.names("decoder")
    for bad in ([("a", ReLU()), ("a", ReLU())], [("a.b", ReLU())], [("", ReLU())]):
        with pytest.raises(ValueError, match="unique"):
            Sequential(bad)
    del params["head.weight"]
    with pytest.raises(KeyError, match=r"head\.weight"):
        model.forward(params, np.ones((1, 2)))


def test_sequential_ignores_extra_names_and_leading_parameterless_layers():
    model = Sequential([("act", ReLU()), ("fc", Linear(2, 2))])
    rng = np.random.default_rng(0)
    params = {**model.init(rng), "other.weight": np.ones(3)}
    x = rng.normal(size=(4, 2))
    y, cache = model.forward(params, x)
    grads, _ = model.backward(params, cache, np.ones_like(y))
    assert (
        sorted(model.param_grads(params, cache, np.ones_like(y))) == sorted(grads) == ["fc.bias", "fc.weight"]
    )


def test_init_schemes():
    rng = np.random.default_rng(0)
    p = Linear(624, 175, init="kaiming").init(rng)
    assert abs(p["weight"].std() / np.sqrt(2 / 624) - 1) < 0.02
    assert abs(p["weight"].mean()) < 3 * np.sqrt(2 / 624) / np.sqrt(p["weight"].size)
    np.testing.assert_array_equal(p["bias"], 0.0)
    p = Linear(50, 4).init(rng)
    bound = 1 / np.sqrt(50)
    assert np.abs(p["weight"]).max() <= bound and np.abs(p["bias"]).max() <= bound
    assert p["weight"].std() > 0.5 * bound / np.sqrt(3)
    with pytest.raises(ValueError, match="kaiming"):
        Linear(2, 2, init="xavier")
    with pytest.raises(ValueError, match="positive integers"):
        mlp([4, 0, 2])
    with pytest.raises(ValueError, match="choose one of"):
        GaussianBasis(4, form="other")


def test_input_width_is_checked():
    with pytest.raises(ValueError, match=r"\(batch, 3\)"):
        Linear(3, 2).forward(Linear(3, 2).init(np.random.default_rng(0)), np.ones((4, 2)))


# -- float32 stays float32 ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "kwargs", "d_in"),
    [
        ("sigmoid_glm", {}, 1),
        ("gaussian_glm", {}, 1),
        ("gaussian_glm", {"form": "paper"}, 1),
        ("printer_nn", {}, 1),
        ("mlp", {"sizes": [6, 5, 3]}, 6),
    ],
)
def test_float32_is_preserved(name, kwargs, d_in):
    from trainer_lite.losses import mse
    from trainer_lite.optim import SGD, Adam

    rng = np.random.default_rng(0)
    model = build_model(name, **kwargs)
    params = model.init(rng, dtype=np.float32)
    x = rng.normal(size=(5, d_in)).astype(np.float32)
    y, cache = model.forward(params, x)
    assert y.dtype == np.float32
    _, dy = mse(y, rng.normal(size=y.shape))  # a float64 target must not promote
    assert dy.dtype == np.float32
    grads, dx = model.backward(params, cache, dy)
    assert dx.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads.values())
    for opt in (Adam(1e-2, weight_decay=1e-3), SGD(1e-2, momentum=0.9, weight_decay=1e-3)):
        opt.step(params, grads)
        opt.step(params, {k: g.astype(np.float64) for k, g in grads.items()})
        assert all(v.dtype == np.float32 for v in params.values())
        assert all(v.dtype == np.float32 for v in opt.state.values())

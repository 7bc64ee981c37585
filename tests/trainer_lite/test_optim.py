"""Optimizers step for step against torch.optim (several steps, weight decay, momentum, dtypes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.budget import examples
from trainer_lite.losses import cross_entropy
from trainer_lite.models import mlp
from trainer_lite.optim import SGD, Adam, AdamW, Optimizer

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

FAST = settings(max_examples=examples(20), deadline=None)
seeds = st.integers(0, 2**31 - 1)
SHAPES = {"a.weight": (3, 4), "a.bias": (4,), "b.scale": (1,)}


def rel_err(ours, ref) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    scale = max(float(np.max(np.abs(ref), initial=0.0)), 1e-300)
    return float(np.max(np.abs(np.asarray(ours, dtype=np.float64) - ref), initial=0.0)) / scale


def run_both(ours: Optimizer, make_torch, params: dict, grad_fn, steps: int, dtype=np.float64):
    """Drive both optimizers with the same gradients ``grad_fn(step, params) -> {name: g or None}``."""
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    tp = {k: torch.tensor(v, dtype=tdtype) for k, v in params.items()}
    topt = make_torch(list(tp.values()))
    ours_p = {k: np.array(v, dtype=dtype) for k, v in params.items()}
    for step in range(steps):
        grads = grad_fn(step, ours_p)
        for k, t in tp.items():
            g = grads.get(k)
            t.grad = None if g is None else torch.tensor(g, dtype=tdtype)
        topt.step()
        ours.step(ours_p, {k: np.asarray(g, dtype=dtype) for k, g in grads.items() if g is not None})
    return ours_p, {k: t.numpy() for k, t in tp.items()}


def random_grads(seed: int):
    rng = np.random.default_rng(seed)
    return lambda step, p: {k: rng.normal(size=s) for k, s in SHAPES.items()}


def init_params(seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    return {k: rng.normal(size=s) for k, s in SHAPES.items()}


@FAST
@given(
    lr=st.sampled_from([1e-3, 3e-3, 0.1]),
    b1=st.sampled_from([0.0, 0.9, 0.5]),
    b2=st.sampled_from([0.999, 0.9]),
    eps=st.sampled_from([1e-8, 1e-3]),
    wd=st.sampled_from([0.0, 3e-4, 0.1]),
    seed=seeds,
)
def test_adam_matches_torch(lr, b1, b2, eps, wd, seed):
    ours, ref = run_both(
        Adam(lr, betas=(b1, b2), eps=eps, weight_decay=wd),
        lambda ps: torch.optim.Adam(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd),
        init_params(seed),
        random_grads(seed),
        steps=12,
    )
    for k in SHAPES:
        assert rel_err(ours[k], ref[k]) <= 1e-10, k


@FAST
@given(lr=st.sampled_from([1e-3, 0.05]), wd=st.sampled_from([0.0, 0.01, 0.3]), seed=seeds)
def test_adamw_matches_torch(lr, wd, seed):
    ours, ref = run_both(
        AdamW(lr, weight_decay=wd),
        lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd),
        init_params(seed),
        random_grads(seed),
        steps=12,
    )
    for k in SHAPES:
        assert rel_err(ours[k], ref[k]) <= 1e-10, k


@FAST
@given(
    lr=st.sampled_from([1e-3, 0.1]),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    wd=st.sampled_from([0.0, 1e-3, 0.1]),
    dampening=st.sampled_from([0.0, 0.3]),
    nesterov=st.booleans(),
    seed=seeds,
)
def test_sgd_matches_torch(lr, momentum, wd, dampening, nesterov, seed):
    if nesterov and (momentum == 0 or dampening != 0):
        with pytest.raises(ValueError, match="Nesterov"):
            SGD(lr, momentum, wd, dampening=dampening, nesterov=nesterov)
        return
    ours, ref = run_both(
        SGD(lr, momentum, wd, dampening=dampening, nesterov=nesterov),
        lambda ps: torch.optim.SGD(
            ps, lr=lr, momentum=momentum, weight_decay=wd, dampening=dampening, nesterov=nesterov
        ),
        init_params(seed),
        random_grads(seed),
        steps=12,
    )
    for k in SHAPES:
        assert rel_err(ours[k], ref[k]) <= 1e-10, k


def test_adam_with_gradients_from_the_parameters():
    """A feedback loop (g = A·p − b) over 50 steps, so every step depends on the previous ones."""
    rng = np.random.default_rng(4)
    a_mat, b_vec = rng.normal(size=(4, 4)), rng.normal(size=4)
    a_mat = a_mat @ a_mat.T + np.eye(4)

    def grads(step, p):
        return {"x": a_mat @ p["x"] - b_vec}

    ours, ref = run_both(
        Adam(0.05, weight_decay=3e-4),
        lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=3e-4),
        {"x": np.zeros(4)},
        grads,
        steps=50,
    )
    assert rel_err(ours["x"], ref["x"]) <= 1e-9


def test_adam_names_that_come_and_go():
    """Steps that skip a name (torch: .grad is None) keep per-name step counts, as torch does."""
    rng = np.random.default_rng(5)
    schedule = [
        set(SHAPES),
        {"a.weight"},
        {"a.weight", "b.scale"},
        set(SHAPES),
        set(SHAPES),
        {"a.bias"},
        set(SHAPES),
    ]

    def grads(step, p):
        return {k: rng.normal(size=s) if k in schedule[step] else None for k, s in SHAPES.items()}

    ours, ref = run_both(
        Adam(0.01, weight_decay=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
        init_params(5),
        grads,
        steps=len(schedule),
    )
    for k in SHAPES:
        assert rel_err(ours[k], ref[k]) <= 1e-10, k


def test_adam_state_can_be_saved_and_restored():
    rng = np.random.default_rng(6)
    seq = [{k: rng.normal(size=s) for k, s in SHAPES.items()} for _ in range(8)]
    p_straight, p_resumed = init_params(6), init_params(6)
    straight = Adam(0.01)
    for g in seq:
        straight.step(p_straight, g)
    first = Adam(0.01)
    for g in seq[:4]:
        first.step(p_resumed, g)
    saved_state = {k: v.copy() for k, v in first.state.items()}
    saved_t = dict(first.t)
    resumed = Adam(0.01)
    resumed.state, resumed.t = saved_state, saved_t
    for g in seq[4:]:
        resumed.step(p_resumed, g)
    for k in SHAPES:
        np.testing.assert_allclose(p_resumed[k], p_straight[k], rtol=1e-14)
    # state entries stay per name and readable
    assert set(straight.state) == {f"{m}.{k}" for m in "mv" for k in SHAPES}
    assert straight.t == dict.fromkeys(SHAPES, 8)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_float32_training_tracks_torch_float32(kind):
    """The FTL-TP MLP trained 20 steps in float32 by both, from the same weights and batches."""
    rng = np.random.default_rng(7)
    model = mlp([20, 16, 8, 3], init="kaiming")
    params = model.init(rng, dtype=np.float32)
    xs = rng.normal(size=(20, 8, 20)).astype(np.float32)
    ys = rng.integers(0, 3, (20, 8))
    grads_seen = {}

    def grads(step, p):
        pred, cache = model.forward(p, xs[step])
        _, d = cross_entropy(pred, ys[step])
        g = model.param_grads(p, cache, d)
        grads_seen.update({k: v.dtype for k, v in g.items()})
        return g

    if kind == "adam":
        ours_opt = Adam(1e-2, weight_decay=1e-3)
        make = lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3)  # noqa: E731
    else:
        ours_opt = SGD(0.05, momentum=0.9, weight_decay=1e-3)
        make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
    # torch gets our gradients (from our float32 parameters), so this isolates the optimizer.
    ours, ref = run_both(ours_opt, make, params, grads, steps=20, dtype=np.float32)
    assert set(grads_seen.values()) == {np.dtype(np.float32)}
    for k in params:
        assert ours[k].dtype == np.float32
        assert rel_err(ours[k], ref[k]) <= 1e-5, k


def test_bad_arguments_and_gradients():
    with pytest.raises(ValueError, match="lr"):
        Adam(0.0)
    with pytest.raises(ValueError, match="betas"):
        Adam(1e-3, betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="momentum"):
        SGD(0.1, momentum=1.0)
    p = {"w": np.zeros(3)}
    for opt in (Adam(0.1), SGD(0.1, momentum=0.9)):
        with pytest.raises(ValueError, match="'w'"):
            opt.step(p, {"w": np.zeros(4)})


@pytest.mark.parametrize("make", [lambda: Adam(1e-3), lambda: SGD(1e-3, momentum=0.9)])
def test_dead_units_never_reach_subnormal_numbers(make):
    """Zero gradients after a burst decay the state geometrically; it must not go subnormal."""
    opt = make()
    p = {"w": np.full(64, 1e-3, np.float32), "u": np.full(8, 0.5, np.float32)}
    tiny = np.finfo(np.float32).tiny
    opt.step(p, {"w": np.full(64, 1e-3, np.float32), "u": np.ones(8, np.float32)})
    p["w"][:] = 0.0  # a unit that died: zero weight, zero gradient from now on
    for _ in range(1500):
        opt.step(p, {"w": np.zeros(64, np.float32), "u": np.ones(8, np.float32)})
        for arr in [*p.values(), *opt.state.values()]:
            assert not np.any((arr != 0) & (np.abs(arr) < tiny))
    assert np.all(p["u"] < 0.5)  # the live unit kept training

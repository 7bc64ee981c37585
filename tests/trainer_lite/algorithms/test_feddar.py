"""FedDAR: second-order aggregation, re-weighting, what leaves the device, and Algorithm 2."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cloud_aggregator.aggregation.second_order import SecondOrderMean, psd_solve, second_order_mean
from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.strategies.feddar import domain_weights
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import check_tensors
from cloud_aggregator.rounds.simulation import ClientData, simulate
from ioft_protocol import codec
from tests.budget import examples
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.base import loss_and_grads
from trainer_lite.algorithms.feddar import (
    COUNTS,
    DOMAIN_WEIGHT,
    head_key,
    hessian_key,
    linear_head_hessian,
)
from trainer_lite.data import Dataset
from trainer_lite.layers import Linear, Sequential
from trainer_lite.task import TaskSpec

D, K, M = 5, 2, 3


def _spec(algorithm: str = "feddar", *, server=None, rounds: int = 3, model_args=None, **hp) -> TaskSpec:
    hparams = {"n_domains": M, "optimizer": "sgd", "lr": 0.05, **hp}
    if algorithm == "feddar_linear":
        hparams = {k: v for k, v in hparams.items() if k in ("n_domains", "reweight")}
    return TaskSpec(
        name="t",
        algorithm=algorithm,
        model="linear_rep",
        model_args=model_args or {"d_in": D, "k": K},
        hparams=hparams,
        server=server or {},
        dtype="float64",
        rounds=rounds,
        seed=1,
    )


def _truth(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    b, _ = np.linalg.qr(rng.standard_normal((D, K)))
    w, _ = np.linalg.qr(rng.standard_normal((M, K)))
    return b, w


def _data(rng: np.random.Generator, domains: np.ndarray, b: np.ndarray, w: np.ndarray, noise=0.0) -> Dataset:
    x = rng.standard_normal((len(domains), D))
    y = np.einsum("nd,dk,nk->n", x, b, w[domains]) + noise * rng.standard_normal(len(domains))
    return Dataset(x, y[:, None], np.asarray(domains))


def _update(device: str, result) -> Update:
    return Update(device, result.shared, result.n_samples, result.metrics)


# -- the pure aggregation ------------------------------------------------------------------


@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    p=st.integers(1, 4),
)
def test_sa_of_locally_optimal_heads_is_the_pooled_least_squares_head(seed, sizes, p):
    """Eq. 8 with α_i ∝ L_i and H_i = (2/L_i) Z_iᵀZ_i, from local minimizers (min-norm where singular)."""
    rng = np.random.default_rng(seed)
    assume(sum(sizes) >= p + 1)
    w_true = rng.standard_normal(p)
    zs = [rng.standard_normal((n, p)) for n in sizes]
    ys = [z @ w_true + 0.3 * rng.standard_normal(len(z)) for z in zs]
    items = []
    for z, y in zip(zs, ys, strict=True):
        if len(z) == 0:
            items.append((np.zeros(p), np.zeros((p, p)), 0.0))
            continue
        local = np.linalg.lstsq(z, y, rcond=None)[0]  # any local minimizer works; this is the min-norm one
        items.append((local, 2.0 / len(z) * z.T @ z, float(len(z))))
    pooled = np.linalg.lstsq(np.vstack(zs), np.concatenate(ys), rcond=None)[0]
    got = second_order_mean(items, rng.standard_normal(p), rcond=1e-12)
    np.testing.assert_allclose(got, pooled, rtol=1e-7, atol=1e-9)


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), p=st.integers(1, 5), rank=st.integers(0, 5))
def test_psd_solve_is_exact_on_the_range_and_keeps_the_fallback_elsewhere(seed, p, rank):
    rng = np.random.default_rng(seed)
    rank = min(rank, p)
    a = rng.standard_normal((p, rank))
    h = a @ a.T
    x_true = rng.standard_normal(p)
    fallback = rng.standard_normal(p)
    x = psd_solve(h, h @ x_true, fallback, rcond=1e-10)
    np.testing.assert_allclose(h @ x, h @ x_true, atol=1e-8 * (1 + np.abs(h).max()))
    # Along the null space of h nothing is known: the fallback stays.
    q, _ = np.linalg.qr(a) if rank else (np.zeros((p, 0)), None)
    null = np.eye(p) - q @ q.T
    np.testing.assert_allclose(null @ x, null @ fallback, atol=1e-8)


def test_second_order_mean_streams_and_merges():
    rng = np.random.default_rng(3)
    items = [
        (rng.standard_normal(3), (lambda a: a @ a.T)(rng.standard_normal((3, 4))), w) for w in (1.0, 2.0, 5.0)
    ]
    whole = SecondOrderMean(3)
    for it in items:
        whole.add(*it)
    left, right = SecondOrderMean(3), SecondOrderMean(3)
    left.add(*items[0])
    for it in items[1:]:
        right.add(*it)
    left.merge(right)
    fb = np.zeros(3)
    np.testing.assert_allclose(left.result(fb), whole.result(fb))
    with pytest.raises(ValueError, match="Hessian"):
        whole.add(np.zeros(3), np.zeros((2, 2)), 1.0)
    with pytest.raises(ValueError, match="weight"):
        whole.add(np.zeros(3), np.eye(3), -1.0)
    # No weight at all: the previous head comes back unchanged.
    np.testing.assert_array_equal(SecondOrderMean(3).result(np.arange(3.0)), np.arange(3.0))


# -- closed-form Hessians ---------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["mse", "bce"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("d_out", [1, 2])
def test_linear_head_hessian_matches_finite_differences_of_the_gradient(loss, bias, d_out):
    rng = np.random.default_rng(7)
    n = 6
    head = Sequential([("head", Linear(K, d_out, bias=bias))])
    params = {k: v * 3 for k, v in head.init(rng).items()}
    z = rng.standard_normal((n, K))
    y = rng.standard_normal((n, d_out)) if loss == "mse" else rng.uniform(0, 1, (n, d_out))
    from trainer_lite.algorithms.base import get_loss

    fn = get_loss(loss)
    names = head.param_names()

    def grad_vec(vec: np.ndarray) -> np.ndarray:
        p, start = {}, 0
        for name in names:
            size = params[name].size
            p[name] = vec[start : start + size].reshape(params[name].shape)
            start += size
        _, g = loss_and_grads(head, p, Dataset(z, y), fn)
        return np.concatenate([g[name].ravel() for name in names])

    vec = np.concatenate([params[name].ravel() for name in names])
    eps = 1e-6
    numeric = np.stack(
        [(grad_vec(vec + eps * e) - grad_vec(vec - eps * e)) / (2 * eps) for e in np.eye(vec.size)], axis=1
    )
    pred = head(params, z)
    np.testing.assert_allclose(linear_head_hessian(z, pred, loss, bias), numeric, rtol=1e-6, atol=1e-8)


# -- client and server together ---------------------------------------------------------------


def _heads_round(spec: TaskSpec, datasets: list[Dataset]):
    algo = make_client(spec)
    strategy = make_strategy(spec)
    g = strategy.init_global()
    rng = np.random.default_rng(0)
    updates = [
        _update(f"d{i}", algo.update(g, {}, ds, rng=rng, round_=1, phase="heads")[0])
        for i, ds in enumerate(datasets)
    ]
    return algo, strategy, g, updates


def test_client_then_server_sa_gives_the_pooled_least_squares_head():
    """Converged local head steps + eq. 8 = least squares on every client's features of that domain."""
    rng = np.random.default_rng(11)
    b, w = _truth()
    # Every local block is one sample (singular Hessian) or several well-spread ones, so
    # gradient descent reaches a local minimizer; eq. 8 assumes it does.
    doms = [
        np.array([0, 0, 0, 0, 1, 1, 1, 1]),
        np.array([0, 2, 2, 2, 2]),
        np.array([1, 1, 1, 1, 0, 2]),
        np.array([0]),
    ]
    datasets = [_data(rng, d, b, w, noise=0.1) for d in doms]
    spec = _spec(aggregation="sa", head_steps=20000, head_lr=0.05)
    _, strategy, g, updates = _heads_round(spec, datasets)
    new = strategy.aggregate(g, updates, round_=1, phase="heads")
    enc = g["encoder.weight"]
    for ds, u in zip(datasets, updates, strict=True):
        for m in np.unique(ds.domain):
            z, y = ds.x[ds.domain == m] @ enc, ds.y[ds.domain == m, 0]
            local = u.params[head_key(m, "head.weight")][:, 0]
            assert np.abs(z.T @ (z @ local - y)).max() < 1e-10, "precondition: local heads converged"
    for m in range(M):
        z = np.vstack([ds.x[ds.domain == m] @ enc for ds in datasets])
        y = np.concatenate([ds.y[ds.domain == m, 0] for ds in datasets])
        pooled = np.linalg.lstsq(z, y, rcond=None)[0]
        np.testing.assert_allclose(new[head_key(m, "head.weight")][:, 0], pooled, rtol=1e-6, atol=1e-8)
    # The encoder is untouched by the heads phase; domain_weight is u_m = L/(L_m·M).
    np.testing.assert_array_equal(new["encoder.weight"], g["encoder.weight"])
    totals = np.bincount(np.concatenate(doms), minlength=M)
    np.testing.assert_allclose(new[DOMAIN_WEIGHT], totals.sum() / (totals * M))


def test_wa_differs_from_sa_when_domain_mixes_differ():
    rng = np.random.default_rng(5)
    b, w = _truth()
    # Domain 0 is seen by two clients whose features are scaled differently: their
    # local heads and Hessians differ, so the count-weighted mean is not the pooled fit.
    a = _data(rng, np.array([0, 0, 0, 1]), b, w, noise=0.2)
    c = _data(rng, np.array([0, 0, 2, 2, 2]), b, w, noise=0.2)
    c = Dataset(3.0 * c.x, c.y, c.domain)
    heads = {}
    for agg in ("sa", "wa"):
        spec = _spec(aggregation=agg, head_steps=20000, head_lr=0.01)
        _, strategy, g, updates = _heads_round(spec, [a, c])
        heads[agg] = strategy.aggregate(g, updates, round_=1, phase="heads")[head_key(0, "head.weight")]
    assert np.abs(heads["sa"] - heads["wa"]).max() > 1e-2


@settings(max_examples=examples(25), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    counts=st.lists(st.lists(st.integers(0, 2), min_size=M, max_size=M), min_size=1, max_size=4),
)
def test_few_sample_and_absent_domains_stay_finite(seed, counts):
    """Domains with 0, 1 or 2 samples on a client (singular local Hessians) or none at all."""
    rng = np.random.default_rng(seed)
    b, w = _truth(seed % 7)
    datasets = []
    for row in counts:
        doms = np.repeat(np.arange(M), row)
        if len(doms):
            datasets.append(_data(rng, rng.permutation(doms), b, w))
    assume(datasets)
    spec = _spec(aggregation="sa", head_steps=50, head_lr=0.1)
    algo, strategy, g, updates = _heads_round(spec, datasets)
    for u in updates:
        assert all(np.isfinite(v).all() for v in u.params.values())
    new = strategy.aggregate(g, updates, round_=1, phase="heads")
    assert all(np.isfinite(v).all() for v in new.values())
    totals = np.sum([np.bincount(ds.domain, minlength=M) for ds in datasets], axis=0)
    for m in range(M):
        key = head_key(m, "head.weight")
        if totals[m] == 0:
            np.testing.assert_array_equal(new[key], g[key])  # nobody saw it: unchanged
    # The encoder phase with these heads and weights stays finite too.
    for ds in datasets:
        out = algo.update(new, {}, ds, rng=rng, round_=1, phase="encoder")[0]
        assert np.isfinite(out.shared["encoder.weight"]).all()


def test_a_single_sample_domain_moves_the_head_only_along_what_it_saw():
    rng = np.random.default_rng(2)
    b, w = _truth()
    ds = _data(rng, np.array([1, 1, 0, 2]), b, w)  # domain 0 and 2: one sample each (k = 2)
    spec = _spec(aggregation="sa", head_steps=5000, head_lr=0.1)
    _, strategy, g, updates = _heads_round(spec, [ds])
    new = strategy.aggregate(g, updates, round_=1, phase="heads")
    enc = g["encoder.weight"]
    for m in (0, 2):
        z = ds.x[ds.domain == m][0] @ enc
        old, got = g[head_key(m, "head.weight")][:, 0], new[head_key(m, "head.weight")][:, 0]
        assert z @ got == pytest.approx(ds.y[ds.domain == m][0, 0], abs=1e-8)  # fits its one sample
        ortho = np.array([-z[1], z[0]])
        assert ortho @ got == pytest.approx(ortho @ old, abs=1e-8)  # unchanged where it saw nothing


@pytest.mark.parametrize(
    ("algorithm", "hp"),
    [("feddar", {"aggregation": "sa"}), ("feddar", {"aggregation": "wa"}), ("feddar_linear", {})],
)
def test_only_declared_tensors_leave_the_client(algorithm, hp):
    """Each phase's upload is exactly what the server's ``expected()`` declares, and holds no sample."""
    rng = np.random.default_rng(0)
    b, w = _truth()
    data = _data(rng, np.array([0, 0, 1, 0, 1, 1, 0]), b, w)  # 7 samples, domain 2 absent
    spec = _spec(algorithm, **hp)
    algo, strategy = make_client(spec), make_strategy(spec)
    g = strategy.init_global()
    assert algo.phases() == ("heads", "encoder")
    for phase in algo.phases():
        result, local = algo.update(g, {}, data, rng=rng, round_=1, phase=phase)
        expected = strategy.expected(g, phase)
        assert sorted(result.shared) == sorted(expected)
        assert check_tensors(result.shared, expected) is None
        valid = [_update("d0", result)]
        # It travels as is: the wire carries exactly these tensors.
        _, sent = codec.decode(codec.encode("update", {"phase": phase}, result.shared))
        assert sorted(sent) == sorted(result.shared)
        assert local == {}
        for name, arr in result.shared.items():
            assert len(data) not in arr.shape, f"{name} has a per-sample axis"
            assert not np.isin(data.x, arr).any() and not np.isin(data.y, arr).any()
        g = strategy.aggregate(g, valid, round_=1, phase=phase)
    if algorithm == "feddar":
        names = set(strategy.expected(g, "heads"))
        assert (hessian_key(0) in names) == (hp["aggregation"] == "sa")
        assert COUNTS in names


def test_heads_phase_trains_only_the_domains_a_client_holds():
    rng = np.random.default_rng(1)
    b, w = _truth()
    data = _data(rng, np.array([0, 0, 0]), b, w)
    spec = _spec(aggregation="sa", head_steps=5, head_lr=0.1)
    _, _, g, (u,) = _heads_round(spec, [data])
    assert not np.allclose(u.params[head_key(0, "head.weight")], g[head_key(0, "head.weight")])
    for m in (1, 2):
        np.testing.assert_array_equal(u.params[head_key(m, "head.weight")], g[head_key(m, "head.weight")])
        np.testing.assert_array_equal(u.params[hessian_key(m)], np.zeros((K, K)))
    np.testing.assert_array_equal(u.params[COUNTS], [3, 0, 0])


def test_reweighted_encoder_objective_is_the_mean_over_domains():
    """Σ_i (L_i/L) R̂_i with u_m = L/(L_m·M) equals (1/M) Σ_m R̂_m (eq. 6)."""
    rng = np.random.default_rng(4)
    b, w = _truth()
    datasets = [_data(rng, d, b, w, noise=0.5) for d in ([0, 0, 1], [1, 2, 2, 2, 2], [0, 2])]
    spec = _spec()
    algo = make_client(spec)
    g = make_strategy(spec).init_global()
    totals = np.sum([np.bincount(ds.domain, minlength=M) for ds in datasets], axis=0)
    u = domain_weights(totals)
    assert float(u @ totals) == pytest.approx(totals.sum())
    enc = algo.encoder_params(g)
    heads = [algo.head_params(g, m) for m in range(M)]
    total = sum(totals)
    lhs = sum(len(ds) / total * algo.encoder_loss_and_grads(enc, heads, ds, u)[0] for ds in datasets)
    x = np.vstack([ds.x for ds in datasets])
    y = np.vstack([ds.y for ds in datasets])
    dom = np.concatenate([ds.domain for ds in datasets])
    pred = algo.predict_domains(g, {}, x, dom)
    rhs = np.mean([np.mean((pred[dom == m] - y[dom == m]) ** 2) for m in range(M)])
    assert lhs == pytest.approx(rhs, rel=1e-12)


def test_domain_weights_skip_domains_nobody_holds():
    np.testing.assert_allclose(domain_weights(np.array([6.0, 0.0, 2.0])), [8 / 12, 0.0, 8 / 4])


def _fleet(seed: int, n: int, samples: int, alpha: float = 0.4):
    rng = np.random.default_rng(seed)
    b, w = _truth(seed)
    clients, tests = {}, {}
    for i in range(n):
        pi = rng.dirichlet(np.full(M, alpha / M))
        clients[f"c{i:02d}"] = ClientData(_data(rng, rng.choice(M, samples, p=pi), b, w, noise=1e-3))
        tests[f"c{i:02d}"] = _data(rng, rng.choice(M, 50, p=pi), b, w)
    return clients, tests, b


def _test_mse(fleet, g, tests) -> float:
    return float(np.mean([fleet.algo.evaluate(g, fleet.local[d], tests[d])["loss"] for d in tests]))


def test_feddar_sa_learns_a_domain_mixed_regression_that_fedavg_cannot():
    clients, tests, _ = _fleet(0, n=20, samples=10)
    sa = _spec(aggregation="sa", rounds=60, head_steps=5, head_lr=0.2, local_steps=5, lr=0.05)
    g, fleet, records = simulate(sa, clients)
    assert [r.phase for r in records[:2]] == ["heads", "encoder"]
    assert _test_mse(fleet, g, tests) < 1e-4
    avg = TaskSpec(
        name="t",
        algorithm="fedavg",
        model="linear_rep",
        model_args={"d_in": D, "k": K},
        hparams={"optimizer": "sgd", "lr": 0.05, "local_steps": 5},
        dtype="float64",
        rounds=60,
        seed=1,
    )
    g_avg, fleet_avg, _ = simulate(avg, clients)
    assert _test_mse(fleet_avg, g_avg, tests) > 1e-2


def test_algorithm_2_keeps_the_encoder_orthonormal_and_converges():
    clients, tests, b_true = _fleet(1, n=20, samples=10)
    spec = _spec("feddar_linear", server={"lr": 0.5}, rounds=40)
    seen = []

    def check(rec, fleet, g):
        b = g["encoder.weight"]
        if rec.phase == "encoder":
            np.testing.assert_allclose(b.T @ b, np.eye(K), atol=1e-12)
            q, _ = np.linalg.qr(b)
            seen.append(np.linalg.norm(b_true - q @ (q.T @ b_true), 2))

    g, fleet, _ = simulate(spec, clients, on_record=check)
    assert seen[-1] < 1e-2 * seen[0]
    assert _test_mse(fleet, g, tests) < 1e-4


def test_algorithm_2_qr_step_leaves_predictions_unchanged():
    """``B ← B − ηG``, then ``B, R = QR(B)`` and ``w ← R w``: ``x·B·w`` is what the raw step predicts."""
    rng = np.random.default_rng(9)
    b, w = _truth()
    data = _data(rng, np.array([0, 1, 2, 0, 1, 2, 2]), b, w)
    spec = _spec("feddar_linear", server={"lr": 0.3})
    algo, strategy = make_client(spec), make_strategy(spec)
    g = strategy.init_global()
    g = strategy.aggregate(
        g,
        [_update("d", algo.update(g, {}, data, rng=rng, round_=1, phase="heads")[0])],
        round_=1,
        phase="heads",
    )
    up = algo.update(g, {}, data, rng=rng, round_=1, phase="encoder")[0]
    new = strategy.aggregate(g, [_update("d", up)], round_=1, phase="encoder")
    raw = g["encoder.weight"] - 0.3 * up.shared["grad.encoder.weight"] / len(data)
    for m in range(M):
        key = head_key(m, "head.weight")
        np.testing.assert_allclose(
            data.x @ new["encoder.weight"] @ new[key], data.x @ raw @ g[key], atol=1e-12
        )


def test_errors_name_what_is_wrong():
    rng = np.random.default_rng(0)
    algo = make_client(_spec())
    g = make_strategy(_spec()).init_global()
    with pytest.raises(ValueError, match="domain"):
        algo.update(
            g, {}, Dataset(rng.standard_normal((3, D)), np.zeros((3, 1))), rng=rng, round_=1, phase="heads"
        )
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        bad = Dataset(rng.standard_normal((2, D)), np.zeros((2, 1)), np.array([0, 3]))
        algo.update(g, {}, bad, rng=rng, round_=1, phase="heads")
    with pytest.raises(ValueError, match="phases are"):
        algo.update(g, {}, _data(rng, np.array([0]), *_truth()), rng=rng, round_=1, phase="train")
    with pytest.raises(ValueError, match="predict_domains"):
        algo.predict(g, {}, np.zeros((1, D)))
    with pytest.raises(ValueError, match="n_domains"):
        make_client(_spec(n_domains=0))
    with pytest.raises(ValueError, match="aggregation"):
        make_client(_spec(aggregation="mean"))
    with pytest.raises(ValueError, match="closed-form"):
        make_client(_spec(aggregation="sa", loss="cross_entropy"))
    with pytest.raises(ValueError, match="bias-free"):
        make_client(_spec("feddar_linear", model_args={"d_in": D, "k": K, "bias": True}))
    strategy = make_strategy(_spec())
    up = Update("dev7", {COUNTS: np.array([1.0, -1.0, 2.0])}, 2)
    with pytest.raises(ValueError, match="dev7"):
        strategy.aggregate(g, [up], round_=1, phase="heads")

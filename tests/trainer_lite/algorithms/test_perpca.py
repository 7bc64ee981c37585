"""Personalized PCA: Stiefel feasibility, the polar retraction, the gradient against torch, what travels."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.simulation import ClientData, simulate
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.perpca import (
    correct_local,
    covariance,
    objective,
    objective_grad,
    polar,
    random_stiefel,
    residual,
    stiefel_step,
    tangent_project,
)
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

D, R1, R2 = 9, 2, 3


def _spec(rounds: int = 5, **hp) -> TaskSpec:
    return TaskSpec(
        name="pp",
        algorithm="perpca",
        model="perpca",
        hparams={"dim": D, "r_global": R1, "r_local": R2, "lr": 0.3, **hp},
        dtype="float64",
        rounds=rounds,
        seed=3,
    )


def _truth(seed: int = 0, n_clients: int = 4) -> tuple[np.ndarray, list[np.ndarray], dict[str, ClientData]]:
    """Clients sharing 2 global directions, each with 3 of its own (orthogonal to the global ones)."""
    rng = np.random.default_rng(seed)
    q = random_stiefel(rng, D, D)
    u = q[:, :R1]
    rest = q[:, R1:]
    vs, clients = [], {}
    for i in range(n_clients):
        v = rest @ random_stiefel(rng, D - R1, R2)
        x = 2.0 * rng.standard_normal((300, R1)) @ u.T + 1.5 * rng.standard_normal((300, R2)) @ v.T
        x += 0.05 * rng.standard_normal((300, D))
        vs.append(v)
        clients[f"d{i}"] = ClientData(Dataset(x, np.zeros((300, 1))))
    return u, vs, clients


def _orth_err(u: np.ndarray, v: np.ndarray) -> float:
    w = np.hstack([u, v])
    return float(np.abs(w.T @ w - np.eye(w.shape[1])).max())


# -- the manifold tools -----------------------------------------------------------------------------


def test_polar_is_the_talks_generalized_retraction_and_keeps_the_column_space():
    rng = np.random.default_rng(1)
    u = random_stiefel(rng, D, 4)
    xi = 0.3 * rng.standard_normal((D, 4))
    got = polar(u + xi)
    # Talk: GR_polar,U(ξ) = (U + ξ)(I + ξᵀU + Uᵀξ + ξᵀξ)^{-1/2}.
    m = np.eye(4) + xi.T @ u + u.T @ xi + xi.T @ xi
    evals, evecs = np.linalg.eigh(m)
    want = (u + xi) @ (evecs @ np.diag(evals**-0.5) @ evecs.T)
    np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_allclose(got.T @ got, np.eye(4), atol=1e-12)
    a = u + xi
    np.testing.assert_allclose(got @ got.T, a @ np.linalg.solve(a.T @ a, a.T), atol=1e-12)
    # Nearest orthonormal matrix: no other point on St(d, r) we try is closer.
    for _ in range(20):
        other = polar(got + 0.1 * rng.standard_normal(got.shape))
        assert np.linalg.norm(a - got) <= np.linalg.norm(a - other) + 1e-12
    # An orthonormal matrix is its own retraction.
    np.testing.assert_allclose(polar(u), u, atol=1e-12)


def test_polar_refuses_a_collapsed_column_space():
    a = np.ones((5, 2))
    with pytest.raises(ValueError, match="rank-deficient"):
        polar(a)


def test_objective_gradient_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, D))
    s = covariance(x, center=True)
    u = rng.standard_normal((D, R1))  # the gradient of eq. (4) is taken in the ambient space
    v = rng.standard_normal((D, R2))
    gu, gv = objective_grad(s, u, v)
    ts = torch.tensor(s, dtype=torch.float64)
    tu = torch.tensor(u, dtype=torch.float64, requires_grad=True)
    tv = torch.tensor(v, dtype=torch.float64, requires_grad=True)
    f = 0.5 * torch.trace(tu.T @ ts @ tu) + 0.5 * torch.trace(tv.T @ ts @ tv)
    f.backward()
    assert abs(f.item() - objective(s, u, v)) <= 1e-12 * abs(f.item())
    for ours, theirs in ((gu, tu.grad.numpy()), (gv, tv.grad.numpy())):
        assert np.linalg.norm(ours - theirs) <= 1e-6 * np.linalg.norm(theirs)
    # The residual the devices report is Tr S − 2 f on orthonormal W (so minimising it is eq. (4)).
    w = random_stiefel(rng, D, R1 + R2)
    xc = x - x.mean(axis=0)
    res = float(np.mean(residual(xc, w[:, :R1], w[:, R1:])))
    assert res == pytest.approx(np.trace(s) - 2 * objective(s, w[:, :R1], w[:, R1:]), rel=1e-12)


def test_tangent_projection_gives_the_riemannian_gradient():
    rng = np.random.default_rng(3)
    w = random_stiefel(rng, D, 4)
    g = rng.standard_normal((D, 4))
    p = tangent_project(w, g)
    np.testing.assert_allclose(w.T @ p + p.T @ w, 0.0, atol=1e-12)  # in the tangent space
    np.testing.assert_allclose(tangent_project(w, p), p, atol=1e-12)  # a projection
    # Its inner product with any tangent vector is the Euclidean gradient's (embedded metric).
    k = rng.standard_normal((4, 4))
    z = w @ (k - k.T) + (np.eye(D) - w @ w.T) @ rng.standard_normal((D, 4))  # built independently
    np.testing.assert_allclose(w.T @ z + z.T @ w, 0.0, atol=1e-12)
    assert np.sum(p * z) == pytest.approx(np.sum(g * z), rel=1e-12)


def test_correction_deflates_and_retracts_keeping_the_deflated_span():
    rng = np.random.default_rng(4)
    u = random_stiefel(rng, D, R1)
    v = random_stiefel(rng, D, R2)
    out = correct_local(u, v)
    assert _orth_err(u, out) < 1e-12
    deflated = v - u @ (u.T @ v)
    np.testing.assert_allclose(out @ out.T, deflated @ np.linalg.pinv(deflated), atol=1e-10)


def test_stiefel_steps_stay_feasible_and_climb_the_objective():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((60, D)) @ rng.standard_normal((D, D))
    s = covariance(x, center=True)
    u = random_stiefel(rng, D, R1)
    v = correct_local(u, random_stiefel(rng, D, R2))
    lr = 1.0 / np.linalg.eigvalsh(s)[-1]
    values = [objective(s, u, v)]
    for _ in range(400):
        u, v = stiefel_step(s, u, v, lr)
        assert _orth_err(u, v) < 1e-10  # UᵀU = I, VᵀV = I and UᵀV = 0
        values.append(objective(s, u, v))
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(values))
    top = np.sort(np.linalg.eigvalsh(s))[::-1][: R1 + R2].sum() / 2
    assert values[-1] == pytest.approx(top, rel=1e-6)  # one client alone: its top-(r1+r2) span


# -- client and server in the house frame ---------------------------------------------------------------


def test_client_uploads_only_u_and_keeps_a_feasible_v():
    _, _, clients = _truth()
    algo = make_client(_spec())
    rng = np.random.default_rng(0)
    shared = algo.init_global(rng)
    algo.check_shared(shared, "train")
    local = algo.init_local(rng)
    result, new_local = algo.update(shared, local, clients["d0"].train, rng=rng, round_=1, phase="train")
    assert list(result.shared) == ["U"] and list(new_local) == ["V"]
    assert result.shared["U"].shape == (D, R1) and new_local["V"].shape == (D, R2)
    assert _orth_err(result.shared["U"], new_local["V"]) < 1e-10
    assert result.metrics["train_loss"] < result.metrics["start_loss"]
    assert set(shared) == {"U"} and set(local) == {"V"}  # inputs untouched
    # After the server's new U arrives, the personal params are corrected to feasibility.
    other = polar(result.shared["U"] + 0.2 * rng.standard_normal((D, R1)))
    p = algo.personal_params({"U": other}, new_local)
    assert _orth_err(p["U"], p["V"]) < 1e-10


def test_server_averages_then_retracts():
    strategy = make_strategy(_spec())
    rng = np.random.default_rng(6)
    g = strategy.init_global()
    ups = [polar(g["U"] + 0.1 * rng.standard_normal(g["U"].shape)) for _ in range(3)]
    out = strategy.aggregate(
        g, [Update(f"d{i}", {"U": u}, 10) for i, u in enumerate(ups)], round_=1, phase="train"
    )
    np.testing.assert_allclose(out["U"], polar(np.mean(ups, axis=0)), atol=1e-12)
    np.testing.assert_allclose(out["U"].T @ out["U"], np.eye(R1), atol=1e-12)
    assert strategy.state() == {}


def test_federated_run_recovers_global_and_local_subspaces():
    u, vs, clients = _truth()
    final, fleet, records = simulate(_spec(rounds=150), clients)
    u_hat = final["U"]
    assert np.linalg.norm(u_hat @ u_hat.T - u @ u.T) ** 2 < 1e-3
    for i, v in enumerate(vs):
        v_hat = fleet.algo.personal_params(final, fleet.local[f"d{i}"])["V"]
        assert _orth_err(u_hat, v_hat) < 1e-10
        assert np.linalg.norm(v_hat @ v_hat.T - v @ v.T) ** 2 < 1e-3
    assert records[-1].mean_metric("train_loss") < 0.1 * records[0].mean_metric("train_loss")


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="exceeds dim"):
        make_client(_spec(r_global=5, r_local=5))
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        make_client(_spec(eta=0.1))
    algo = make_client(_spec())
    with pytest.raises(ValueError, match="features"):
        algo.update(
            algo.init_global(np.random.default_rng(0)),
            algo.init_local(np.random.default_rng(0)),
            Dataset(np.zeros((4, D + 1)), np.zeros((4, 1))),
            rng=np.random.default_rng(0),
            round_=1,
            phase="train",
        )


@pytest.mark.broker
def test_over_mqtt_matches_the_in_process_simulation(fleet_procs):
    """The same client and strategy between processes over mosquitto: the same U, bit for bit."""
    import json

    from cloud_aggregator.local.fleet import aggregator_toml
    from cloud_aggregator.store.sqlite import SqliteStore
    from edge.dataset import save_dataset
    from trainer_lite.params import param_hash

    task = {
        "name": "perpca",
        "algorithm": "perpca",
        "model": "perpca",
        "hparams": {"dim": D, "r_global": R1, "r_local": R2, "lr": 0.3},
        "dtype": "float64",
        "rounds": 4,
        "seed": 3,
    }
    _, _, clients = _truth(n_clients=3)
    devices = sorted(clients)
    for device, data in clients.items():
        save_dataset(fleet_procs.work / device, data.train, data.train, {"source": "test"})
        fleet_procs.start_device(device, simulate=None)
    fleet_procs.start_aggregator(
        aggregator_toml(fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=devices)
    )
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")[-3000:]
    records = fleet_procs.rounds("perpca")
    assert [(r.round, r.status) for r in records] == [(r, "completed") for r in range(1, 5)]
    store = SqliteStore(fleet_procs.db, readonly=True)
    try:
        over_mqtt = store.resume_point("perpca")[2]
    finally:
        store.close()
    spec = TaskSpec.from_json(json.dumps(task))
    sim_clients = {d: ClientData(c.train, c.train) for d, c in clients.items()}
    in_process, _, _ = simulate(spec, sim_clients)
    assert sorted(over_mqtt) == ["U"]
    assert param_hash(over_mqtt) == param_hash(in_process)


def test_server_takes_a_robust_reducer_like_fedavg():
    """``server = {reducer = ...}`` (was 'unknown hyperparameters ["reducer"]'); the retraction follows."""
    import dataclasses

    rng = np.random.default_rng(7)
    mean_strategy = make_strategy(_spec())
    g = mean_strategy.init_global()
    honest = [polar(g["U"] + 0.05 * rng.standard_normal(g["U"].shape)) for _ in range(6)]
    attack = [g["U"] - 100.0 * (honest[0] - g["U"])]  # a scaled, sign-flipped change
    updates = [Update(f"d{i}", {"U": u}, 10) for i, u in enumerate(honest + attack)]
    clean = polar(np.mean(honest, axis=0))

    def gap(u: np.ndarray) -> float:  # distance between the spanned subspaces
        return float(np.linalg.norm(u @ u.T - clean @ clean.T))

    mean_out = mean_strategy.aggregate(g, updates, round_=1, phase="train")["U"]
    for server in ({"reducer": "median"}, {"reducer": "trimmed_mean", "reducer_args": {"beta": 0.2}},
                   {"reducer": "krum", "reducer_args": {"f": 1}}):  # fmt: skip
        strategy = make_strategy(dataclasses.replace(_spec(), server=server))
        assert strategy.config.reducer == server["reducer"]
        out = strategy.aggregate(g, updates, round_=1, phase="train")["U"]
        np.testing.assert_allclose(out.T @ out, np.eye(R1), atol=1e-12)  # still on the Stiefel manifold
        assert gap(out) < 0.3 < 1.0 < gap(mean_out), server  # Krum (m=1) picks one honest upload
    # The default is still the plain weighted mean, bit for bit.
    out = mean_strategy.aggregate(g, updates[:6], round_=1, phase="train")["U"]
    np.testing.assert_array_equal(out, polar(np.mean(honest, axis=0)))
    with pytest.raises(ValueError, match="reducer"):
        make_strategy(dataclasses.replace(_spec(), server={"reducer": "mode"}))

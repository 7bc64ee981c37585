"""FedPP / FEDORA: λ rules, principal-angle similarity, propagation, what travels, state across a restart."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.strategies.fedpp import (
    orthonormalize,
    principal_cosines,
    propagate,
    propagate_iterative,
    similarity_matrix,
    top_k,
    transition,
)
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.engine import MemoryStore, RoundEngine
from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet
from cloud_aggregator.rounds.types import CollectRequest
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.base import run_local_steps
from trainer_lite.algorithms.fedpp import (
    BASIS,
    SEND_BASIS,
    selective_lambda,
    subspace_basis,
    validation_split,
)
from trainer_lite.algorithms.pflda import PERSONAL
from trainer_lite.data import Dataset
from trainer_lite.params import copy_params, strip_prefix
from trainer_lite.task import TaskSpec

SIZES = [6, 5, 3]
MODEL_NAMES = ["fc0.bias", "fc0.weight", "fc1.bias", "fc1.weight"]


def _spec(rounds: int = 3, server=None, **hp) -> TaskSpec:
    return TaskSpec(
        name="pp",
        algorithm="fedpp",
        model="mlp",
        model_args={"sizes": SIZES},
        hparams={"subspace_dim": 2, "local_steps": 4, "lr": 0.01, **hp},
        server={"alpha": 1.0, **(server or {})},
        dtype="float64",
        rounds=rounds,
        seed=5,
    )


def _data(rng: np.random.Generator, n: int, shift: float = 0.0) -> Dataset:
    x = rng.normal(size=(n, SIZES[0])) + shift
    return Dataset(x, (x[:, 0] > shift).astype(np.int64) + (x[:, 1] > shift).astype(np.int64))


def _clients(n: int = 3, seed: int = 0) -> dict[str, ClientData]:
    rng = np.random.default_rng(seed)
    return {f"d{i}": ClientData(_data(rng, 12 + i, shift=float(i % 2))) for i in range(n)}


class RecordingFleet(SimulatedFleet):
    """The in-process fleet, remembering requests and uploads; ``absent`` skips devices in given rounds."""

    def __init__(self, *args, absent: dict[int, set[str]] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.absent = absent or {}
        self.requests: list[CollectRequest] = []
        self.uploads: list[list[Update]] = []

    def sample(self, round_: int) -> list[str]:
        return [d for d in super().sample(round_) if d not in self.absent.get(round_, set())]

    def collect(self, request):
        self.requests.append(request)
        out = super().collect(request)
        self.uploads.append(list(out))
        return out


# -- λ: selective regularization --------------------------------------------------------


def test_slides_rule_is_the_loss_gap_floored_at_eps():
    assert selective_lambda(1.5, 1.0, "max", eps=1e-8) == pytest.approx(0.5)
    assert selective_lambda(1.0, 1.5, "max", eps=1e-8) == 1e-8  # θ̂ worse: (almost) local training
    assert selective_lambda(1.0, 1.0, "max", eps=1e-3) == 1e-3


def test_code_rule_is_zero_when_aux_is_worse_else_exp_half_gap():
    assert selective_lambda(1.0, 1.5, "exp") == 0.0
    assert selective_lambda(1.0, 1.0, "exp") == 1.0
    assert selective_lambda(3.0, 1.0, "exp") == pytest.approx(math.e)


def test_unknown_lambda_rule_and_bad_hparams_are_refused():
    with pytest.raises(ValueError, match="lam_rule"):
        selective_lambda(1.0, 0.0, "linear")
    with pytest.raises(ValueError, match="lam_rule"):
        make_client(_spec(lam_rule="linear"))
    with pytest.raises(ValueError, match="val_fraction"):
        make_client(_spec(val_fraction=1.0))
    with pytest.raises(ValueError, match="alpha"):
        make_strategy(_spec(server={"alpha": -1.0}))


def test_pull_is_off_when_aux_is_worse_and_on_when_it_is_better():
    spec = _spec(lam_rule="exp", val_fraction=0.25)
    algo = make_client(spec)
    data = _data(np.random.default_rng(1), 40)
    rng0 = np.random.default_rng(0)
    good = algo.model.init(rng0)
    run_local_steps(
        algo.model, good, MODEL_NAMES, data, algo.loss, algo.config.make_optimizer(1), 300, None, rng0
    )
    bad = {n: v * 0 for n, v in good.items()}  # uniform predictions: worse on the validation rows
    flag = {SEND_BASIS: np.zeros(1)}

    # θ̂ worse than θ_k: λ = 0, and θ_k trains exactly as alone.
    local = {f"{PERSONAL}.{n}": v for n, v in good.items()}
    res, new = algo.update(
        {**bad, **flag}, local, data, rng=np.random.default_rng(3), round_=1, phase="train"
    )
    assert res.metrics["lam"] == 0.0 and res.metrics["val_gap"] < 0
    alone = copy_params(good)
    train, _ = validation_split(data, 0.25, spec.seed)
    run_local_steps(
        algo.model, alone, MODEL_NAMES, train, algo.loss, algo.config.make_optimizer(1), 4, None,
        np.random.default_rng(3),
    )  # fmt: skip
    for n in MODEL_NAMES:
        np.testing.assert_array_equal(strip_prefix(new, PERSONAL)[n], alone[n])

    # θ̂ better: λ ≥ 1 and θ_k ends nearer θ̂ than the same steps without the pull.
    local = {f"{PERSONAL}.{n}": v for n, v in bad.items()}
    res, new = algo.update(
        {**good, **flag}, local, data, rng=np.random.default_rng(3), round_=1, phase="train"
    )
    assert res.metrics["lam"] >= 1.0
    free = copy_params(bad)
    run_local_steps(
        algo.model, free, MODEL_NAMES, train, algo.loss, algo.config.make_optimizer(1), 4, None,
        np.random.default_rng(3),
    )  # fmt: skip
    dist = lambda p: sum(float(np.sum((p[n] - good[n]) ** 2)) for n in MODEL_NAMES)  # noqa: E731
    assert dist(strip_prefix(new, PERSONAL)) < dist(free)


# -- the client objective's gradient, exactly --------------------------------------


def _pull_setup(lam_rule: str = "max"):
    """A FedPP client taking one full-batch SGD step, with θ_k and a better θ̂_k (so λ_k > 0)."""
    spec = _spec(lam_rule=lam_rule, val_fraction=0.25, optimizer="sgd", lr=0.2, local_steps=1)
    algo = make_client(spec)
    data = _data(np.random.default_rng(7), 40)
    rng = np.random.default_rng(2)
    aux = algo.model.init(rng)
    run_local_steps(
        algo.model, aux, MODEL_NAMES, data, algo.loss, make_client(_spec(lr=0.05)).config.make_optimizer(1),
        200, None, rng,
    )  # fmt: skip
    theta = {n: v + 0.4 * rng.normal(size=v.shape) for n, v in aux.items()}  # θ_k: θ̂_k plus noise
    shared = {**aux, SEND_BASIS: np.zeros(1)}
    local = {f"{PERSONAL}.{n}": v for n, v in theta.items()}
    res, new = algo.update(shared, local, data, rng=np.random.default_rng(3), round_=1, phase="train")
    train, val = validation_split(data, 0.25, spec.seed)
    return algo, theta, aux, train, val, res, strip_prefix(new, PERSONAL)


def test_one_local_step_adds_exactly_two_lambda_times_theta_minus_aux_by_hand():
    """θ' = θ − η(∇ℓ(θ) + 2λ(θ − θ̂)): the pulled step minus the free one is −2ηλ(θ − θ̂)."""
    algo, theta, aux, train, val, res, stepped = _pull_setup()
    lam = res.metrics["lam"]
    # The slides' rule: λ = ℓ(θ; val) − ℓ(θ̂; val), measured before the step.
    assert lam == pytest.approx(algo.val_loss(theta, val) - algo.val_loss(aux, val), rel=1e-12)
    assert lam > 0.05  # the pull is really in play
    free = copy_params(theta)
    run_local_steps(
        algo.model, free, MODEL_NAMES, train, algo.loss, algo.config.make_optimizer(1), 1, None,
        np.random.default_rng(3),
    )  # fmt: skip
    lr = algo.config.lr
    for n in MODEL_NAMES:
        pull = 2.0 * lam * (theta[n] - aux[n])
        assert np.linalg.norm(pull) > 0.1 * np.linalg.norm((theta[n] - free[n]) / lr)  # not swamped by ∇ℓ
        np.testing.assert_allclose(stepped[n] - free[n], -lr * pull, rtol=1e-9, atol=1e-13, err_msg=n)


@pytest.mark.torch
@pytest.mark.parametrize("lam_rule", ["max", "exp"])
def test_one_local_step_is_the_torch_gradient_of_loss_plus_lambda_squared_distance(lam_rule):
    """One full-batch SGD step on CE(θ; train) + λ‖θ − θ̂‖² (λ a constant read from the val losses), float64."""
    torch = pytest.importorskip("torch")
    algo, theta, aux, train, val, res, stepped = _pull_setup(lam_rule)

    def forward(params, x):
        h = torch.tensor(x)
        for i in range(len(SIZES) - 1):
            h = h @ params[f"fc{i}.weight"] + params[f"fc{i}.bias"]
            if i < len(SIZES) - 2:
                h = torch.relu(h)
        return h

    ce = torch.nn.functional.cross_entropy
    t_aux = {n: torch.tensor(v) for n, v in aux.items()}
    tp = {n: torch.tensor(v, requires_grad=True) for n, v in theta.items()}
    with torch.no_grad():
        gap = float(
            ce(forward(tp, val.x), torch.tensor(val.y)) - ce(forward(t_aux, val.x), torch.tensor(val.y))
        )
    lam = max(1e-8, gap) if lam_rule == "max" else (0.0 if gap < 0 else math.exp(gap / 2))
    assert res.metrics["lam"] == pytest.approx(lam, rel=1e-12) and lam > 0.05
    objective = ce(forward(tp, train.x), torch.tensor(train.y))
    objective = objective + lam * sum(((tp[n] - t_aux[n]) ** 2).sum() for n in tp)
    objective.backward()
    lr = algo.config.lr
    for n in MODEL_NAMES:
        want = theta[n] - lr * tp[n].grad.numpy()
        np.testing.assert_allclose(stepped[n], want, rtol=1e-10, atol=1e-12, err_msg=n)


def test_validation_rows_are_the_same_every_round_and_held_out():
    data = _data(np.random.default_rng(2), 20)
    a_train, a_val = validation_split(data, 0.25, seed=5)
    _, b_val = validation_split(data, 0.25, seed=5)
    assert len(a_val) == 5 and len(a_train) == 15
    np.testing.assert_array_equal(a_val.x, b_val.x)
    rows = {tuple(r) for r in a_train.x}
    assert not any(tuple(r) in rows for r in a_val.x)


# -- subspaces and similarity -----------------------------------------------------------


def test_basis_is_orthonormal_leading_singular_vectors_with_labels_appended():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 4))
    y = rng.integers(0, 3, size=30)
    b = subspace_basis(x, 3, y, 3)
    assert b.shape == (7, 3)
    np.testing.assert_allclose(b.T @ b, np.eye(3), atol=1e-12)
    _, _, vt = np.linalg.svd(np.concatenate([x, np.eye(3)[y]], axis=1), full_matrices=False)
    np.testing.assert_allclose(np.abs(b.T @ vt[0]), [1, 0, 0], atol=1e-10)
    with pytest.raises(ValueError, match="subspace_dim"):
        subspace_basis(x[:2], 3)


def test_identical_subspaces_give_the_maximum_similarity_and_orthogonal_ones_zero():
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    a = q[:, :3]
    same = a @ np.linalg.qr(rng.normal(size=(3, 3)))[0]  # another basis of the same span
    orth = q[:, 3:6]
    half = np.column_stack([q[:, 0], q[:, 4], q[:, 5]])  # shares one direction with a
    np.testing.assert_allclose(principal_cosines(a, same), [1, 1, 1], atol=1e-12)
    np.testing.assert_allclose(principal_cosines(a, orth), [0, 0, 0], atol=1e-12)
    w = similarity_matrix([a, same, orth, half])
    assert w[0, 1] == pytest.approx(3.0) and w[0, 2] == pytest.approx(0.0, abs=1e-12)
    assert w[0, 3] == pytest.approx(1.0)
    np.testing.assert_array_equal(np.diag(w), 0.0)
    np.testing.assert_allclose(w, w.T)
    # The authors' sharpened kernel keeps the order and the diagonal.
    e = similarity_matrix([a, same, orth, half], kernel="exp", temperature=2.0)
    assert e[0, 1] == pytest.approx(math.exp(6.0)) and e[0, 2] == pytest.approx(1.0)
    # A rank-deficient upload is reduced to its span before the angles are taken.
    assert orthonormalize(np.column_stack([a[:, 0], 2 * a[:, 0]])).shape == (8, 1)


def test_top_k_keeps_each_rows_largest_neighbours():
    w = np.array([[0, 3, 1, 2], [3, 0, 5, 4], [1, 5, 0, 0.5], [2, 4, 0.5, 0]], dtype=float)
    t = top_k(w, 2)
    np.testing.assert_array_equal(t[0], [0, 3, 0, 2])
    np.testing.assert_array_equal(t[1], [0, 0, 5, 4])
    np.testing.assert_array_equal(t[2], [1, 5, 0, 0])
    np.testing.assert_array_equal(top_k(w, None), w)


# -- propagation ------------------------------------------------------------------------


def test_closed_form_by_hand_on_three_clients():
    # Path graph 1 - 2 - 3, α = 1 (β = 1/2): (I − ½ D⁻¹W) Θ̂ = Θ/2.
    w = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=float)
    theta = np.array([[1.0, 2.0], [0.0, 2.0], [0.0, 2.0]])
    hat = propagate(theta, w, alpha=1.0)
    # Column 1 solved by hand: x1 − x2/2 = 1/2, −x1/4 + x2 − x3/4 = 0, −x2/2 + x3 = 0.
    np.testing.assert_allclose(hat[:, 0], [7 / 12, 1 / 6, 1 / 12], atol=1e-12)
    # A parameter all clients agree on is left where it is.
    np.testing.assert_allclose(hat[:, 1], [2.0, 2.0, 2.0], atol=1e-12)


def test_closed_form_is_the_fixed_point_of_the_iteration():
    rng = np.random.default_rng(3)
    raw = rng.uniform(0, 3, size=(7, 7))
    w = (raw + raw.T) / 2
    theta = rng.normal(size=(7, 11))
    for alpha in (0.5, 4.0, 20.0):
        for k in (None, 2):
            wk = top_k(w, k)
            closed = propagate(theta, wk, alpha)
            np.testing.assert_allclose(closed, propagate_iterative(theta, wk, alpha), atol=1e-9)
            # and it satisfies the iteration's update exactly
            p, beta = transition(wk), alpha / (1 + alpha)
            np.testing.assert_allclose(closed, beta * p @ closed + theta / (1 + alpha), atol=1e-12)


def test_alpha_zero_and_isolated_devices_keep_their_own_model():
    theta = np.arange(6.0).reshape(3, 2)
    w = np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=float)
    np.testing.assert_allclose(propagate(theta, w, 0.0), theta)
    hat = propagate(theta, w, 4.0)
    np.testing.assert_allclose(hat[2], theta[2])  # no neighbour: θ̂ = θ, not θ/(1+α)
    np.testing.assert_allclose(hat[0] + hat[1], theta[0] + theta[1])  # a 2-cycle mixes, conserving the sum


# -- what travels -----------------------------------------------------------------------


def test_basis_goes_up_once_and_each_device_gets_its_own_propagated_model():
    spec = _spec(rounds=3)
    fleet = RecordingFleet(spec, _clients(3))
    engine = RoundEngine(spec, fleet)
    engine.run()
    names = sorted(MODEL_NAMES)
    # Round 1: nobody is known: the broadcast asks for the basis; every upload carries it.
    assert fleet.requests[0].downlinks == {}
    assert fleet.requests[0].global_params[SEND_BASIS][0] == 1.0
    assert all(sorted(u.params) == sorted([*names, BASIS]) for u in fleet.uploads[0])
    assert all(u.params[BASIS].shape == (SIZES[0] + SIZES[-1], 2) for u in fleet.uploads[0])
    # Later rounds: a per-device downlink each, the flag cleared, θ_k only going up.
    for r in (1, 2):
        req = fleet.requests[r]
        assert sorted(req.downlinks) == ["d0", "d1", "d2"]
        assert all(dl[SEND_BASIS][0] == 0.0 for dl in req.downlinks.values())
        assert all(sorted(spec_) == names for spec_ in req.expected_by_device.values())
        assert all(sorted(u.params) == names for u in fleet.uploads[r])
    # The round-2 downlinks are Θ̂ = closed form over the round-1 uploads, row by row.
    strategy = engine.strategy
    devices = sorted(u.device for u in fleet.uploads[0])
    flat = np.stack([np.concatenate([np.ravel(u.params[n]) for n in names]) for u in fleet.uploads[0]])
    hat = propagate(flat, strategy.weights, 1.0)
    for row, d in zip(hat, devices, strict=True):
        got = np.concatenate([np.ravel(fleet.requests[1].downlinks[d][n]) for n in names])
        np.testing.assert_allclose(got, row, atol=1e-12)
    assert not np.allclose(
        fleet.requests[1].downlinks["d0"]["fc0.weight"], fleet.requests[1].downlinks["d1"]["fc0.weight"]
    )


def test_what_goes_up_is_the_personal_model_and_nothing_else():
    spec = _spec(rounds=2)
    fleet = RecordingFleet(spec, _clients(3))
    RoundEngine(spec, fleet).run()
    for u in fleet.uploads[-1]:
        personal = strip_prefix(fleet.local[u.device], PERSONAL)
        assert sorted(personal) == sorted(u.params)  # the local state is θ_k and only θ_k
        for n in personal:
            np.testing.assert_array_equal(u.params[n], personal[n])
        assert set(u.metrics) >= {"lam", "val_gap", "train_loss"}


def test_a_device_that_joins_late_is_asked_for_its_basis_then():
    spec = _spec(rounds=3)
    fleet = RecordingFleet(spec, _clients(3), absent={1: {"d2"}})
    RoundEngine(spec, fleet).run()
    assert sorted(u.device for u in fleet.uploads[0]) == ["d0", "d1"]
    assert "d2" not in fleet.requests[1].downlinks  # unknown: it gets the broadcast
    by_device = {u.device: u for u in fleet.uploads[1]}
    assert BASIS in by_device["d2"].params and BASIS not in by_device["d0"].params
    assert sorted(fleet.requests[2].downlinks) == ["d0", "d1", "d2"]


def test_an_upload_without_basis_from_an_unknown_device_is_refused():
    spec = _spec()
    strategy = make_strategy(spec)
    g = strategy.init_global()
    params = {n: g[n] for n in MODEL_NAMES}
    with pytest.raises(ValueError, match=r"no 'fedpp\.basis'"):
        strategy.aggregate(g, [Update("x", params, 3)], round_=1, phase="train")


# -- persistence ------------------------------------------------------------------------


def test_state_round_trips_through_json():
    spec = _spec(rounds=2, server={"top_k": 1})
    engine = RoundEngine(spec, SimulatedFleet(spec, _clients(4)))
    engine.run()
    state = json.loads(json.dumps(engine.strategy.state()))
    fresh = make_strategy(spec)
    fresh.load_state(state)
    g = engine.global_params
    assert fresh.devices == engine.strategy.devices
    np.testing.assert_array_equal(fresh.weights, engine.strategy.weights)
    for d, dl in engine.strategy.downlinks(g).items():
        for n, v in dl.items():
            np.testing.assert_array_equal(fresh.downlinks(g)[d][n], v)
    assert (
        fresh.expected_by_device(g, "train").keys() == engine.strategy.expected_by_device(g, "train").keys()
    )
    with pytest.raises(ValueError, match="unknown keys"):
        fresh.load_state({"bases": {}, "theta": {}, "w": []})


def test_a_restarted_aggregator_ends_where_an_uninterrupted_one_does():
    clients = _clients(3)
    whole = SimulatedFleet(_spec(rounds=4), clients)
    RoundEngine(_spec(rounds=4), whole).run()

    store = MemoryStore()
    fleet = SimulatedFleet(_spec(rounds=4), clients)  # the devices keep their state
    RoundEngine(_spec(rounds=2), fleet, store=store).run()
    # A new process: a fresh strategy, resumed from the store (state through JSON, as SQLite keeps it).
    task = _spec().name
    r, i, g, state = store.resume_point(task)
    assert (r, i) == (3, 0)
    store._point[task] = (r, i, g, json.loads(json.dumps(state)))
    RoundEngine(_spec(rounds=4), fleet, store=store).run()
    assert [rec.round for rec in store.records] == [1, 2, 3, 4]
    for d in clients:
        assert sorted(fleet.local[d]) == sorted(whole.local[d])
        for n, v in whole.local[d].items():
            np.testing.assert_array_equal(fleet.local[d][n], v)

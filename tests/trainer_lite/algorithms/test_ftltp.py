"""FTL-TP: what travels to and from each task group, Algorithm 1's weighted means, the L2R gradient, CTL."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import Admission, check_tensors
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet, simulate
from cloud_aggregator.rounds.types import CollectRequest, Reason
from ioft_protocol.round_messages import UpdateMessage
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.base import algorithm_state, get_loss
from trainer_lite.algorithms.centralised import centralised_transfer, train_centralised
from trainer_lite.algorithms.fedl2r import l2r_loss_and_grads, split_after, train_l2r
from trainer_lite.algorithms.ftltp import group_key
from trainer_lite.data import Dataset
from trainer_lite.models import mlp
from trainer_lite.optim import SGD
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

SIZES = [6, 5, 4, 3, 2]  # a small 4-block MLP standing in for 624-175-125-50-C
GROUPS = {"M": 4, "S": 3}
DEVICES = {"m0": "M", "m1": "M", "m2": "M", "s0": "S", "s1": "S"}


def _spec(device_groups=None, rounds: int = 1, fraction=1.0, **hp) -> TaskSpec:
    return TaskSpec(
        name="w",
        algorithm="ftltp",
        model="mlp",
        model_args={"sizes": SIZES, "init": "kaiming"},
        hparams={"groups": GROUPS, **hp},
        server={"device_groups": device_groups or DEVICES, "client_fraction": fraction},
        dtype="float64",
        rounds=rounds,
        seed=3,
    )


def _data(rng: np.random.Generator, n: int, n_classes: int) -> Dataset:
    return Dataset(rng.normal(size=(n, SIZES[0])), rng.integers(0, n_classes, size=n))


def _clients(sizes: dict[str, int], devices=None, seed: int = 0) -> dict[str, ClientData]:
    rng = np.random.default_rng(seed)
    devices = devices or DEVICES
    return {d: ClientData(_data(rng, n, GROUPS[devices[d]])) for d, n in sizes.items()}


class RecordingFleet(SimulatedFleet):
    """The in-process fleet, remembering each round's request and uploads."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[CollectRequest] = []
        self.uploads: list[list[Update]] = []

    def collect(self, request):
        self.requests.append(request)
        out = super().collect(request)
        self.uploads.append(list(out))
        return out


# -- what travels where ---------------------------------------------------------------


def test_each_group_is_sent_and_uploads_only_the_base_and_its_own_blocks():
    spec = _spec(rounds=2)
    fleet = RecordingFleet(spec, _clients({"m0": 9, "m1": 7, "m2": 8, "s0": 5, "s1": 6}))
    engine = RoundEngine(spec, fleet)
    final = engine.run()
    base = ["fc0.bias", "fc0.weight"]
    own = {
        g: sorted(base + [group_key(g, f"fc{i}.{p}") for i in (1, 2, 3) for p in ("weight", "bias")])
        for g in GROUPS
    }
    assert sorted(final) == sorted(set(own["M"]) | set(own["S"]))
    for request, uploads in zip(fleet.requests, fleet.uploads, strict=True):
        assert set(request.downlinks) == set(DEVICES)
        for device, group in DEVICES.items():
            assert sorted(request.downlinks[device]) == own[group]
            # The same base goes to both groups; each group's blocks are the server's.
            for n in request.downlinks[device]:
                np.testing.assert_array_equal(request.downlinks[device][n], request.global_params[n])
        assert sorted(u.device for u in uploads) == sorted(DEVICES)
        for u in uploads:
            assert sorted(u.params) == own[DEVICES[u.device]]
    # Nothing kept but the device's own progress, nothing else sent.
    assert all(algorithm_state(local) == {} for local in fleet.local.values())
    assert {r.status for r in engine.store.records} == {"completed"}
    # The groups' heads differ in width: M has 4 classes, S has 3.
    assert final[group_key("M", "fc3.weight")].shape == (3, 4)
    assert final[group_key("S", "fc3.weight")].shape == (3, 3)


def test_a_device_refuses_a_downlink_with_other_groups_blocks():
    spec = _spec()
    algo = make_client(spec)
    full = make_strategy(spec).init_global()
    data = _data(np.random.default_rng(0), 4, 4)
    with pytest.raises(ValueError, match=r"one task group.*\['M', 'S'\]"):
        algo.check_shared(full, "train")
    only_m = {n: full[n] for n in algo.names_for("M")}
    algo.check_shared(only_m, "train")
    broken = dict(only_m)
    del broken["fc0.bias"]
    with pytest.raises(ValueError, match=r"missing \['fc0.bias'\]"):
        algo.check_shared(broken, "train")
    result, _ = algo.update(only_m, {}, data, rng=np.random.default_rng(1), round_=1, phase="train")
    assert sorted(result.shared) == sorted(only_m)


def test_uploads_with_another_groups_names_are_rejected_before_aggregation():
    spec = _spec()
    strategy = make_strategy(spec)
    g = strategy.init_global()
    by_device = strategy.expected_by_device(g, "train")
    m_names = make_client(spec).names_for("M")
    s_upload = {n: g[n] for n in make_client(spec).names_for("S")}
    good = Update("m0", {n: g[n] for n in m_names}, 4)
    wrong = Update("m1", s_upload, 4)  # an M device uploading S's blocks
    assert check_tensors(good.params, by_device.get("m0", strategy.expected(g, "train"))) is None
    refusal = check_tensors(wrong.params, by_device.get("m1", strategy.expected(g, "train")))
    assert refusal.reason is Reason.SHAPE_DTYPE and "group.M" in refusal.detail


# -- Algorithm 1: sample-weighted aggregation -----------------------------------------


def test_aggregation_is_algorithm_1_by_hand():
    """Base over every upload by n_k; each group's blocks over its own uploads; idle groups keep theirs."""
    spec = TaskSpec(
        name="w",
        algorithm="ftltp",
        model="mlp",
        model_args={"sizes": [2, 2, 2]},
        hparams={"groups": {"A": 2, "B": 3, "C": 2}},
        server={"device_groups": {"a1": "A", "a2": "A", "b1": "B", "c1": "C"}},
        dtype="float64",
    )
    strategy = make_strategy(spec)
    g = strategy.init_global()
    rng = np.random.default_rng(5)

    def upload(group: str) -> dict[str, np.ndarray]:
        return {n: rng.normal(size=g[n].shape) for n in strategy.client.names_for(group)}

    ups = {"a1": (upload("A"), 2), "a2": (upload("A"), 6), "b1": (upload("B"), 4)}
    updates = [Update(d, p, n) for d, (p, n) in ups.items()]
    new = strategy.aggregate(g, updates, round_=1, phase="train")
    for n in ("fc0.weight", "fc0.bias"):
        want = (2 * ups["a1"][0][n] + 6 * ups["a2"][0][n] + 4 * ups["b1"][0][n]) / 12
        np.testing.assert_allclose(new[n], want, rtol=1e-12)
    for n in (group_key("A", "fc1.weight"), group_key("A", "fc1.bias")):
        np.testing.assert_allclose(new[n], (2 * ups["a1"][0][n] + 6 * ups["a2"][0][n]) / 8, rtol=1e-12)
    for n in (group_key("B", "fc1.weight"), group_key("B", "fc1.bias")):
        np.testing.assert_array_equal(new[n], ups["b1"][0][n])
    for n in (group_key("C", "fc1.weight"), group_key("C", "fc1.bias")):
        np.testing.assert_array_equal(new[n], g[n])  # no C device took part
    assert sorted(new) == sorted(g)


def test_client_fraction_selects_per_group_and_the_rest_is_rejected():
    devices = {**{f"m{i}": "M" for i in range(6)}, **{f"s{i}": "S" for i in range(3)}}
    spec = _spec(device_groups=devices, fraction=1 / 3)
    strategy = make_strategy(spec)
    picks = [strategy.participants(r) for r in range(1, 9)]
    for chosen in picks:
        assert sum(d.startswith("m") for d in chosen) == 2  # round(6/3)
        assert sum(d.startswith("s") for d in chosen) == 1  # max(1, round(3/3))
    assert len({tuple(p) for p in picks}) > 1  # redrawn every round
    assert strategy.participants(4) == make_strategy(spec).participants(4)  # seeded: a resume agrees
    per_group = _spec(device_groups=devices, fraction={"M": 0.5, "S": 1.0})
    assert sum(d.startswith("s") for d in make_strategy(per_group).participants(1)) == 3
    # An upload from a device the server did not pick is never aggregated.
    g = strategy.init_global()
    chosen = picks[0]
    outsider = next(d for d in devices if d not in chosen)
    names = strategy.client.names_for(devices[outsider])
    request = CollectRequest(
        spec, 1, "train", g, param_hash(g), {}, strategy.expected(g, "train"), tuple(chosen),
        strategy.expected_by_device(g, "train"),
    )  # fmt: skip
    upload = UpdateMessage(
        "sim", spec.name, outsider, 1, "train", 3, param_hash(g), {}, {n: g[n] for n in names}
    )
    assert Admission("sim").judge(outsider, upload, request).reason is Reason.NOT_SELECTED


def test_only_the_selected_devices_train():
    devices = {**{f"m{i}": "M" for i in range(3)}, **{f"s{i}": "S" for i in range(3)}}
    spec = _spec(device_groups=devices, rounds=3, fraction=2 / 3)
    fleet = RecordingFleet(spec, _clients(dict.fromkeys(devices, 5), devices))
    RoundEngine(spec, fleet).run()
    strategy = make_strategy(spec)
    for r, uploads in enumerate(fleet.uploads, start=1):
        assert sorted(u.device for u in uploads) == strategy.participants(r)
        assert len(uploads) == 4


def test_one_group_without_regularisers_is_fedavg():
    """FTL-TP reduces to FedAvg (E = 1) with a single group, α = μ = 0: the same weights, bit for bit."""
    rng = np.random.default_rng(2)
    clients = {f"c{i}": ClientData(_data(rng, 11, 2)) for i in range(3)}
    common = {"lr": 5e-3, "batch_size": 4, "loss": "cross_entropy"}
    ftl = TaskSpec(
        name="w",
        algorithm="ftltp",
        model="mlp",
        model_args={"sizes": SIZES, "init": "kaiming"},
        hparams={"groups": {"G": 2}, "alpha_l2r": 0.0, "mu": 0.0, "epochs": 1, **common},
        server={"device_groups": dict.fromkeys(clients, "G")},
        dtype="float64",
        rounds=3,
        seed=1,
    )
    avg = TaskSpec(
        name="w",
        algorithm="fedavg",
        model="mlp",
        model_args={"sizes": SIZES, "init": "kaiming"},
        hparams={"local_steps": math.ceil(11 / 4), **common},
        dtype="float64",
        rounds=3,
        seed=1,
    )
    ours, _, _ = simulate(ftl, clients)
    ref, _, _ = simulate(avg, clients)
    for n, v in ref.items():  # FedAvg's mean streams (compensated float64 sums): equal to rounding
        np.testing.assert_allclose(
            ours[n if n.startswith("fc0.") else group_key("G", n)], v, rtol=1e-12, atol=0
        )


# -- the local objective against torch ----------------------------------------------

torch_only = pytest.mark.torch


def _torch_objective(torch, params, x, y, k_base: int, alpha: float, mu: float, anchor):
    """CE + α·mean‖z‖² (z after the k-th ReLU) + μ/2‖θ − θ_t‖², by autograd."""
    tp = {n: torch.tensor(v, requires_grad=True) for n, v in params.items()}
    h = torch.tensor(x)
    z = None
    for i in range(len(SIZES) - 1):
        h = h @ tp[f"fc{i}.weight"] + tp[f"fc{i}.bias"]
        if i < len(SIZES) - 2:
            h = torch.relu(h)
        if i == k_base - 1:
            z = h
    loss = torch.nn.functional.cross_entropy(h, torch.tensor(y))
    loss = loss + alpha * (z * z).sum(dim=1).mean()
    if mu:
        loss = loss + mu / 2 * sum(((tp[n] - torch.tensor(anchor[n])) ** 2).sum() for n in tp)
    loss.backward()
    return float(loss.detach()), {n: t.grad.numpy() for n, t in tp.items()}


@torch_only
@pytest.mark.parametrize("k_base", [1, 2, 3])
def test_l2r_gradient_matches_torch(k_base):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(k_base)
    model = mlp(SIZES, init="kaiming")
    params = model.init(rng)
    params = {n: v + 0.1 * rng.normal(size=v.shape) for n, v in params.items()}  # non-zero biases
    x, y = rng.normal(size=(7, SIZES[0])), rng.integers(0, SIZES[-1], size=7)
    base, head = split_after(model, k_base)
    alpha = 0.37
    out = l2r_loss_and_grads(base, head, params, Dataset(x, y), get_loss("cross_entropy"), alpha)
    value, ref = _torch_objective(torch, params, x, y, k_base, alpha, 0.0, None)
    np.testing.assert_allclose(out.task + out.l2r, value, rtol=1e-12)
    assert out.l2r > 0.01 * out.task  # the regulariser is really in play
    for n in params:
        np.testing.assert_allclose(out.grads[n], ref[n], rtol=1e-9, atol=1e-12, err_msg=n)
    # Without the term the base's gradient differs: the test above checks the L2R part itself.
    plain = l2r_loss_and_grads(base, head, params, Dataset(x, y), get_loss("cross_entropy"), 0.0)
    assert not np.allclose(plain.grads["fc0.weight"], out.grads["fc0.weight"])


@torch_only
def test_ftltp_local_step_is_the_torch_gradient_of_eq_5():
    """One full-batch SGD step of the FTL-TP objective (CE + α L2R + μ prox) from θ ≠ θ_t."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    model = mlp(SIZES, init="kaiming")
    anchor = model.init(rng)
    params = {n: v + 0.05 * rng.normal(size=v.shape) for n, v in anchor.items()}
    x, y = rng.normal(size=(6, SIZES[0])), rng.integers(0, SIZES[-1], size=6)
    base, head = split_after(model, 1)
    lr, alpha, mu = 0.1, 0.2, 0.7
    stepped = {n: v.copy() for n, v in params.items()}
    train_l2r(
        base, head, stepped, sorted(stepped), Dataset(x, y), get_loss("cross_entropy"), SGD(lr=lr), 1, None,
        np.random.default_rng(0), alpha=alpha, mu=mu, anchor=anchor,
    )  # fmt: skip
    _, ref = _torch_objective(torch, params, x, y, 1, alpha, mu, anchor)
    for n in params:
        np.testing.assert_allclose(stepped[n], params[n] - lr * ref[n], rtol=1e-10, atol=1e-12, err_msg=n)


@torch_only
def test_ftltp_device_round_is_torch_adam_on_eq_5_minibatches():
    """A device's whole round (E = 1: ⌈n/B⌉ Adam steps, §5.1's α, μ, B, η) against torch on the same batches.

    The L2R term is α times the *batch mean* of ‖z_n‖² (eq. 6; ``(z*z).sum(1).mean()``), z the
    base output after its ReLU, added once; the last, short batch is averaged over its own size.
    """
    torch = pytest.importorskip("torch")
    spec = TaskSpec(
        name="w",
        algorithm="ftltp",
        model="mlp",
        model_args={"sizes": [12, 7, 5, 4, 2], "init": "kaiming"},
        hparams={"groups": {"M": 4, "S": 3}, "epochs": 1},  # α 0.001, μ 0.01, B 8, η 5e-4
        dtype="float64",
    )
    algo = make_client(spec)
    shared = {n: v for n, v in algo.init_global(np.random.default_rng(0)).items() if n in algo.names_for("M")}
    rng = np.random.default_rng(1)
    data = Dataset(3.0 * rng.normal(size=(21, 12)), rng.integers(0, 4, size=21))  # batches 8, 8, 5
    result, _ = algo.update(shared, {}, data, rng=np.random.default_rng(5), round_=1, phase="train")

    anchor = algo.personal_params(shared, {})
    tp = {n: torch.tensor(v, requires_grad=True) for n, v in anchor.items()}
    opt = torch.optim.Adam(list(tp.values()), lr=5e-4)
    order = np.random.default_rng(5).permutation(len(data))  # the device's minibatch order
    steps = 0
    for start in range(0, len(data), 8):
        b = order[start : start + 8]
        h, z = torch.tensor(data.x[b]), None
        for i in range(4):
            h = h @ tp[f"fc{i}.weight"] + tp[f"fc{i}.bias"]
            h = torch.relu(h) if i < 3 else h
            z = h if i == 0 else z
        loss = torch.nn.functional.cross_entropy(h, torch.tensor(data.y[b]))
        loss = loss + 0.001 * (z * z).sum(dim=1).mean()
        loss = loss + 0.01 / 2 * sum(((tp[n] - torch.tensor(anchor[n])) ** 2).sum() for n in tp)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    assert steps == 3
    for n, t in tp.items():
        ours = result.shared[n if n.startswith("fc0.") else group_key("M", n)]
        np.testing.assert_allclose(ours, t.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=n)
        assert not np.allclose(ours, anchor[n])  # every parameter moved


def test_feature_standardizer_from_federated_sums_equals_the_pooled_fit():
    from sensors.features.scaling import Standardizer, feature_sums

    rng = np.random.default_rng(0)
    scales = np.array([1e-8, 1e-3, 1.0, 300.0])
    parts = [rng.normal(loc=5.0, size=(n, 4)) * scales for n in (7, 30, 12)]
    parts[0][:, 0] = 2.5  # a feature constant on one device only
    pooled = Standardizer.fit(np.concatenate(parts))
    summed = Standardizer.from_sums([feature_sums(p) for p in parts])
    np.testing.assert_allclose(summed.mean, pooled.mean, rtol=1e-12)
    np.testing.assert_allclose(summed.std, pooled.std, rtol=1e-6)
    z = pooled.transform(np.concatenate(parts), dtype=np.float64)
    np.testing.assert_allclose(z.mean(axis=0), 0.0, atol=1e-9)
    np.testing.assert_allclose(z.std(axis=0), 1.0, rtol=1e-9)
    const = Standardizer.fit(np.full((5, 2), 3.0))  # a constant feature is centred, not divided by 0
    np.testing.assert_array_equal(const.std, 1.0)
    np.testing.assert_array_equal(const.transform(np.full((1, 2), 4.0)), [[1.0, 1.0]])
    with pytest.raises(ValueError, match="4 features"):
        pooled.transform(np.zeros((2, 3)))


# -- CTL ---------------------------------------------------------------------------


def test_ctl_freezes_the_transferred_base_and_trains_the_rest():
    rng = np.random.default_rng(4)
    src_model, tgt_model = mlp([6, 5, 4, 3], init="kaiming"), mlp([6, 5, 4, 2], init="kaiming")
    src, tgt = _data(rng, 24, 3), _data(rng, 20, 2)
    out = centralised_transfer(
        src_model, tgt_model, src, tgt, get_loss("cross_entropy"),
        base_layers=2, epochs=3, batch_size=8, lr=1e-2, rng=np.random.default_rng(0),
    )  # fmt: skip
    fresh = src_model.init(np.random.default_rng(0))
    for n in ("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"):
        np.testing.assert_array_equal(out.target[n], out.source[n])  # frozen: bit for bit
        assert not np.allclose(out.source[n], fresh[n])  # and it was trained on the source
    assert out.target["fc2.weight"].shape == (4, 2)
    # The head was fine-tuned: it is not the target model's fresh draw any more.
    again = centralised_transfer(
        src_model, tgt_model, src, tgt, get_loss("cross_entropy"),
        base_layers=2, epochs=3, batch_size=8, lr=1e-2, rng=np.random.default_rng(0), finetune_epochs=1,
    )  # fmt: skip
    assert not np.allclose(again.target["fc2.weight"], out.target["fc2.weight"])


def test_train_centralised_leaves_frozen_names_untouched():
    model = mlp([6, 5, 3], init="kaiming")
    p0 = model.init(np.random.default_rng(1))
    data = _data(np.random.default_rng(2), 16, 3)
    p1, metrics = train_centralised(
        model, p0, data, get_loss("cross_entropy"), epochs=2, batch_size=4, lr=1e-2,
        rng=np.random.default_rng(3), trainable=["fc1.weight", "fc1.bias"],
    )  # fmt: skip
    np.testing.assert_array_equal(p1["fc0.weight"], p0["fc0.weight"])
    assert not np.allclose(p1["fc1.weight"], p0["fc1.weight"])
    assert np.isfinite(metrics["train_loss"])
    with pytest.raises(ValueError, match="not parameters"):
        train_centralised(
            model, p0, data, get_loss("cross_entropy"), epochs=1, batch_size=4, lr=1e-2,
            rng=np.random.default_rng(3), trainable=["fc9.weight"],
        )  # fmt: skip


# -- configuration errors ----------------------------------------------------------


def test_configuration_errors_name_the_problem():
    with pytest.raises(ValueError, match="groups"):
        make_client(_spec(groups={}))
    with pytest.raises(ValueError, match="a head must remain"):
        make_client(_spec(base_layers=4))
    with pytest.raises(ValueError, match=r"groups \[.X.\] that hparams"):
        make_strategy(_spec(device_groups={"d": "X"}))
    with pytest.raises(ValueError, match="client_fraction"):
        make_strategy(_spec(fraction=0.0))
    with pytest.raises(ValueError, match=r"no entry for groups \['S'\]"):
        make_strategy(_spec(fraction={"M": 0.5}))


def test_fedl2r_shares_everything_and_regularises_the_penultimate_output():
    spec = TaskSpec(
        name="w",
        algorithm="fedl2r",
        model="mlp",
        model_args={"sizes": SIZES},
        hparams={"loss": "cross_entropy", "epochs": 1, "batch_size": 4},
        dtype="float64",
    )
    algo = make_client(spec)
    assert algo.base.param_names() == [f"fc{i}.{p}" for i in range(3) for p in ("weight", "bias")]
    shared = algo.init_global(np.random.default_rng(0))
    data = _data(np.random.default_rng(1), 10, SIZES[-1])
    result, local = algo.update(shared, {}, data, rng=np.random.default_rng(2), round_=1, phase="train")
    assert local == {} and sorted(result.shared) == sorted(shared) and result.metrics["l2r"] > 0
    assert make_strategy(spec).name == "fedavg"  # the server step is FedAvg's weighted mean

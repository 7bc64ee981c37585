"""GIFAIR-FL weighting: weights by hand, the registry, errors, clipping, state across a restart."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.aggregation.weighting import GifairWeighting, get_weighting
from cloud_aggregator.rounds.simulation import ClientData, simulate
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

GROUPS = {"d1": "A", "d2": "A", "d3": "B", "d4": "C"}


def _updates(losses: dict[str, float], n: dict[str, int] | None = None, params=None) -> list[Update]:
    n = n or {"d1": 10, "d2": 30, "d3": 20, "d4": 40}
    return [
        Update(
            d,
            (params or {}).get(d, {"w": np.zeros(2)}),
            n[d],
            {"train_loss_start": v, "train_loss": 9.0, "test_loss": 9.0},
        )
        for d, v in losses.items()
    ]


def test_weights_by_hand_on_four_clients_in_three_groups():
    # p = n / Σn = (0.1, 0.3, 0.2, 0.4); L_A = mean(1, 3) = 2, L_B = 5, L_C = 0.5.
    # r_A = sign(2−5) + sign(2−0.5) = 0, r_B = +2, r_C = −2; |A| = 2, |B| = |C| = 1.
    # p_i (1 + λ r_i / (p_i |A_si|)) with λ = 0.05:
    #   d1: 0.1, d2: 0.3, d3: 0.2 (1 + 0.05·2/0.2) = 0.3, d4: 0.4 (1 − 0.05·2/0.4) = 0.3.
    weigh = get_weighting("gifair", {"lam": 0.05, "groups": GROUPS})
    w = weigh(_updates({"d1": 1.0, "d2": 3.0, "d3": 5.0, "d4": 0.5}), 1)
    np.testing.assert_allclose(w, [0.1, 0.3, 0.3, 0.3], atol=1e-15)
    assert sum(w) == pytest.approx(1.0)  # r is antisymmetric: the total mass is kept
    assert weigh.last["rank"] == {"A": 0.0, "B": 2.0, "C": -2.0}
    # Uniform base: p = 1/4; d3: 0.25 + 0.05·2 = 0.35, d4: 0.25 − 0.1 = 0.15, d1 = d2 = 0.25.
    uni = get_weighting("gifair", {"lam": 0.05, "groups": GROUPS, "base": "uniform"})
    np.testing.assert_allclose(
        uni(_updates({"d1": 1.0, "d2": 3.0, "d3": 5.0, "d4": 0.5}), 1), [0.25, 0.25, 0.35, 0.15]
    )


def test_ties_count_zero_and_lambda_zero_is_the_base_weighting():
    weigh = get_weighting("gifair", {"lam": 0.2, "groups": GROUPS})
    w = weigh(_updates({"d1": 1.0, "d2": 1.0, "d3": 1.0, "d4": 1.0}), 1)
    np.testing.assert_allclose(w, [0.1, 0.3, 0.2, 0.4])
    zero = get_weighting("gifair", {"lam": 0.0, "groups": GROUPS})
    ups = _updates({"d1": 1.0, "d2": 3.0, "d3": 5.0, "d4": 0.5})
    samples = get_weighting("samples")(ups, 1)
    np.testing.assert_allclose(zero(ups, 1), np.asarray(samples) / sum(samples))


def test_the_loss_metric_is_chosen_by_name():
    for name in ("train_loss", "test_loss"):
        weigh = get_weighting("gifair", {"lam": 0.05, "groups": GROUPS, "loss_metric": name})
        # Every train_loss and test_loss is 9.0: all groups tie, so the weights are the base ones.
        np.testing.assert_allclose(
            weigh(_updates({"d1": 1.0, "d2": 3.0, "d3": 5.0, "d4": 0.5}), 1), [0.1, 0.3, 0.2, 0.4]
        )


def test_the_default_ranks_by_the_training_loss_at_the_downlinked_model_not_the_test_loss():
    # The talk's F_i is a training loss: the default reads FedAvg's train_loss_start (PerPCA's
    # start_loss), never test_loss, even when an upload carries both and they disagree.
    ups = [
        Update("d1", {}, 10, {"train_loss_start": 1.0, "test_loss": 50.0}),
        Update("d3", {}, 20, {"train_loss_start": 5.0, "test_loss": 0.0}),
    ]
    weigh = get_weighting("gifair", {"lam": 0.05, "groups": GROUPS, "base": "uniform"})
    np.testing.assert_allclose(weigh(ups, 1), [0.5 - 0.05, 0.5 + 0.05])  # B (d3) ranks above A
    assert weigh.last["group_loss"] == {"A": 1.0, "B": 5.0}
    perpca = get_weighting("gifair", {"lam": 0.05, "groups": GROUPS, "base": "uniform"})
    ups = [Update("d1", {}, 10, {"start_loss": 1.0}), Update("d3", {}, 20, {"start_loss": 5.0})]
    np.testing.assert_allclose(perpca(ups, 1), [0.45, 0.55])


def test_registry_and_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="gifair"):
        get_weighting("no-such-weighting")
    with pytest.raises(ValueError, match="lam must be"):
        get_weighting("gifair", {"lam": -1.0, "groups": GROUPS})
    with pytest.raises(ValueError, match="base must be"):
        get_weighting("gifair", {"lam": 0.1, "groups": GROUPS, "base": "median"})
    with pytest.raises(TypeError):
        get_weighting("gifair", {"groups": GROUPS})  # λ is required
    weigh = get_weighting("gifair", {"lam": 0.1, "groups": GROUPS})
    with pytest.raises(ValueError, match=r"'d9'.*no group"):
        weigh([Update("d9", {}, 5, {"test_loss": 1.0})], 1)
    with pytest.raises(ValueError, match=r"no metric among \['train_loss_start', 'start_loss'\]"):
        weigh([Update("d1", {}, 5, {"train_loss": 1.0, "test_loss": 1.0})], 1)
    named = get_weighting("gifair", {"lam": 0.1, "groups": GROUPS, "loss_metric": "test_loss"})
    with pytest.raises(ValueError, match=r"no metric 'test_loss'.*loss_metric"):
        named([Update("d1", {}, 5, {"train_loss": 1.0})], 1)
    with pytest.raises(ValueError, match="loss_metric must be"):
        get_weighting("gifair", {"lam": 0.1, "groups": GROUPS, "loss_metric": ""})


def test_negative_weights_are_clipped_with_a_warning(caplog):
    weigh = get_weighting("gifair", {"lam": 0.5, "groups": GROUPS})
    with caplog.at_level(logging.WARNING, logger="cloud_aggregator.aggregation.weighting"):
        w = weigh(_updates({"d1": 1.0, "d2": 3.0, "d3": 5.0, "d4": 0.5}), 1)
    # d4: 0.4 − 0.5·2 < 0 → 0; d3: 0.2 + 0.5·2 = 1.2.
    np.testing.assert_allclose(w, [0.1, 0.3, 1.2, 0.0])
    assert "clipping" in caplog.text


def test_absent_groups_keep_their_last_loss_across_a_restart():
    weigh = GifairWeighting(0.05, GROUPS)
    weigh(_updates({"d1": 1.0, "d2": 3.0, "d3": 5.0, "d4": 0.5}), 1)
    saved = weigh.state()
    assert saved == {"group_loss": {"A": 2.0, "B": 5.0, "C": 0.5}}
    restarted = GifairWeighting(0.05, GROUPS)
    restarted.load_state(saved)
    # Round 2: only A and C upload; B (absent) still ranks above both with its last loss 5.
    ups = _updates({"d1": 0.2, "d4": 1.0})
    w = restarted(ups, 2)
    p = np.array([10, 40]) / 50
    # r_A = sign(0.2 − 5) + sign(0.2 − 1) = −2 (|A| = 1 this round); r_C = −1 + 1 = 0.
    np.testing.assert_allclose(w, [p[0] - 0.05 * 2, p[1]])
    fresh = GifairWeighting(0.05, GROUPS)  # without the state, B is unknown and left out
    np.testing.assert_allclose(fresh(ups, 2), [p[0] - 0.05, p[1] + 0.05])
    with pytest.raises(ValueError, match="unknown state keys"):
        restarted.load_state({"bogus": 1})


def test_fedavg_strategy_takes_gifair_and_persists_its_state():
    spec = TaskSpec(
        name="g",
        algorithm="fedavg",
        model="linear",
        model_args={"d_in": 2, "d_out": 1},
        hparams={"optimizer": "sgd", "lr": 0.1, "local_steps": 1},
        server={"weighting": "gifair", "weighting_args": {"lam": 0.05, "groups": GROUPS}},
        dtype="float64",
        rounds=1,
    )
    strategy = make_strategy(spec)
    g = strategy.init_global()
    rng = np.random.default_rng(0)
    params = {d: {k: rng.standard_normal(v.shape) for k, v in g.items()} for d in GROUPS}
    out = strategy.aggregate(
        g, _updates({"d1": 1.0, "d2": 3.0, "d3": 5.0, "d4": 0.5}, params=params), round_=1, phase="train"
    )
    w = dict(zip(GROUPS, [0.1, 0.3, 0.3, 0.3], strict=True))
    for k in g:
        np.testing.assert_allclose(
            out[k], sum(w[d] * params[d][k] for d in GROUPS) / sum(w.values()), atol=1e-12
        )
    restarted = make_strategy(spec)
    restarted.load_state(strategy.state())
    assert restarted.weigh.group_loss == {"A": 2.0, "B": 5.0, "C": 0.5}


def test_one_reweighted_fedavg_round_is_one_gradient_step_on_h():
    # With one local SGD step, the GIFAIR-weighted mean of the uploads is w − η Σ p_i c_i ∇F_i(w):
    # a gradient step on H(w) = Σ p_i (1 + λ r_i / (p_i |A_si|)) F_i(w).
    rng = np.random.default_rng(1)
    groups = {"a0": "A", "a1": "A", "a2": "A", "b0": "B"}
    clients = {}
    for d in groups:
        x = rng.standard_normal((20, 2)) + (2.0 if d == "b0" else 0.0)
        y = x @ np.array([1.0, -1.0]) + (3.0 if d == "b0" else 0.0)
        # The test rows are unrelated noise: the weights must not depend on them.
        test = Dataset(rng.standard_normal((20, 2)), 10.0 * rng.standard_normal((20, 1)))
        clients[d] = ClientData(Dataset(x, y[:, None]), test)
    lam, lr = 0.1, 0.05
    spec = TaskSpec(
        name="g",
        algorithm="fedavg",
        model="linear",
        model_args={"d_in": 2, "d_out": 1},
        hparams={"optimizer": "sgd", "lr": lr, "local_steps": 1},
        server={"weighting": "gifair", "weighting_args": {"lam": lam, "groups": groups, "base": "uniform"}},
        dtype="float64",
        rounds=1,
        seed=4,
    )
    final, _, records = simulate(spec, clients)
    w0 = make_strategy(spec).init_global()
    losses = records[0].metrics
    for d, c in clients.items():  # F_i(w0): the downlinked model's mse on the training rows
        resid = c.train.x @ w0["head.weight"] + w0["head.bias"] - c.train.y
        assert losses[d]["train_loss_start"] == pytest.approx(np.mean(resid**2), rel=1e-12)
    l_a = np.mean([losses[d]["train_loss_start"] for d in ("a0", "a1", "a2")])
    l_b = losses["b0"]["train_loss_start"]
    assert l_b > l_a  # the shifted group starts worse, so it gains weight
    coef = {
        d: 0.25 + lam * (np.sign(l_a - l_b) / 3 if g == "A" else np.sign(l_b - l_a))
        for d, g in groups.items()
    }
    step = {k: np.zeros_like(v) for k, v in w0.items()}
    for d, c in clients.items():
        resid = c.train.x @ w0["head.weight"] + w0["head.bias"] - c.train.y
        scale = 2.0 / resid.size  # trainer_lite's mse: mean over every element
        step["head.weight"] += coef[d] * scale * c.train.x.T @ resid
        step["head.bias"] += coef[d] * scale * resid.sum(axis=0)
    for k in w0:
        np.testing.assert_allclose(final[k], w0[k] - lr * step[k], atol=1e-12)


@pytest.mark.broker
def test_gifair_over_mqtt_matches_the_in_process_simulation_and_stores_its_state(fleet_procs):
    """Devices report train_loss_start over the wire; the aggregator reweights and persists the group losses."""
    import json

    from cloud_aggregator.local.fleet import aggregator_toml
    from cloud_aggregator.store.sqlite import SqliteStore
    from edge.dataset import save_dataset
    from trainer_lite.params import param_hash

    groups = {"a0": "A", "a1": "A", "b0": "B"}
    task = {
        "name": "fair",
        "algorithm": "fedavg",
        "model": "linear",
        "model_args": {"d_in": 2, "d_out": 1},
        "hparams": {"optimizer": "sgd", "lr": 0.05, "local_steps": 1},
        "server": {
            "weighting": "gifair",
            "weighting_args": {"lam": 0.1, "groups": groups, "base": "uniform"},
        },
        "dtype": "float64",
        "rounds": 3,
        "seed": 2,
    }
    rng = np.random.default_rng(3)
    clients = {}
    for d, g in groups.items():
        x = rng.standard_normal((20, 2)) + (1.0 if g == "B" else 0.0)
        y = (x @ np.array([1.0, -1.0]) + (2.0 if g == "B" else 0.0))[:, None]
        clients[d] = ClientData(Dataset(x[:12], y[:12]), Dataset(x[12:], y[12:]))
        save_dataset(fleet_procs.work / d, clients[d].train, clients[d].test, {"source": "test"})
        fleet_procs.start_device(d, simulate=None)
    fleet_procs.start_aggregator(
        aggregator_toml(
            fleet_procs.broker_url, fleet_procs.work / "aggregator", [task], expected=sorted(groups)
        )
    )
    assert fleet_procs.wait_aggregator(120) == 0, fleet_procs.log("aggregator")[-3000:]
    records = fleet_procs.rounds("fair")
    assert all("train_loss_start" in m for r in records for m in r.metrics.values())
    store = SqliteStore(fleet_procs.db, readonly=True)
    try:
        point = store.resume_point("fair")
    finally:
        store.close()
    over_mqtt, saved_state = point[2], point[3]
    spec = TaskSpec.from_json(json.dumps(task))
    in_process, _, sim_records = simulate(spec, clients)
    assert param_hash(over_mqtt) == param_hash(in_process)
    last = sim_records[-1].metrics
    start = {d: m["train_loss_start"] for d, m in last.items()}
    want = {"A": np.mean([start["a0"], start["a1"]]), "B": start["b0"]}
    assert saved_state["group_loss"] == pytest.approx(want, rel=1e-12)

"""DP-FedAvg on the aggregator: the accountant against dp-accounting, the noisy means, refusals,
the ledger across a restart, the ε budget stop over the in-process simulator, and ``fleet privacy``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import tomllib

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from cloud_aggregator import cli
from cloud_aggregator.aggregation.accountant import calibrate, epsilon
from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.simulation import ClientData, SimulatedFleet
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol.config import ConfigError, build
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

DP = {"mode": "central", "clip": 0.5, "noise_multiplier": 1.1, "delta": 1e-5, "devices_per_round": 3}
SPEC = TaskSpec("speed", "fedavg", "sigmoid_glm", hparams={"lr": 0.1, "local_steps": 3}, rounds=4, dp=DP)


def _direct(z: float, q: float, rounds: int, delta: float) -> float:
    acc = RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize(("z", "q", "rounds"), [(1.1, 0.01, 100), (1.0, 1.0, 10), (4.0, 0.3, 50)])
def test_epsilon_is_dp_accountings_rdp_for_the_subsampled_gaussian(z, q, rounds):
    assert epsilon([z] * rounds, q, 1e-5) == pytest.approx(_direct(z, q, rounds, 1e-5), rel=1e-9)
    # RDP is an upper bound: the tighter PLD accountant finds no more than it.
    pld = PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    assert pld.get_epsilon(1e-5) <= epsilon([z] * rounds, q, 1e-5)


def test_epsilon_grows_with_rounds_and_calibration_hits_its_target():
    eps = [epsilon([1.1] * r, 0.1, 1e-5) for r in range(1, 8)]
    assert all(a < b for a, b in itertools.pairwise(eps))
    z = calibrate(4.0, 30, 1.0, 1e-5)
    assert 3.98 < epsilon([z] * 30, 1.0, 1e-5) <= 4.0
    assert epsilon([z * 0.995] * 30, 1.0, 1e-5) > 4.0  # the smallest such multiplier, near enough


def _update(device: str, change: float, names=("decoder.weight", "decoder.bias"), base=None) -> Update:
    base = base or {n: np.zeros(1, np.float32) for n in names}
    return Update(device, {n: base[n] + np.float32(change) for n in names}, 10)


def test_fedavg_under_dp_sums_clipped_changes_adds_z_c_noise_and_divides_by_the_fixed_count():
    strategy = make_strategy(SPEC)
    g = strategy.init_global()
    strategy.privacy.rng = np.random.default_rng(5)
    updates = [_update(d, c, tuple(g), g) for d, c in (("a", 0.1), ("b", 10.0))]
    out = strategy.aggregate(g, updates, round_=1, phase="train")
    noise = np.random.default_rng(5)
    expected = {}
    for n in sorted(g):  # the same draws, in the same (name) order
        big = 10.0 * 0.5 / (10.0 * np.sqrt(len(g)))  # b's change, clipped jointly to C = 0.5
        expected[n] = g[n] + (0.1 + big + noise.normal(0.0, 1.1 * 0.5, g[n].shape)) / 3
    for n in g:
        np.testing.assert_allclose(out[n], expected[n], rtol=1e-5)
    assert strategy.record_extra()["dp"]["rounds"] == 1
    assert strategy.record_extra()["dp"]["epsilon"] == pytest.approx(epsilon([1.1], 1.0, 1e-5), rel=1e-5)


def test_distributed_rounds_with_missing_devices_are_accounted_with_the_noise_they_had():
    spec = dataclasses.replace(SPEC, dp={**DP, "mode": "distributed"})
    strategy = make_strategy(spec)
    g = strategy.init_global()
    strategy.aggregate(g, [_update("a", 0.1, tuple(g), g)], round_=1, phase="train")  # 1 of 3 came
    z_had = 1.1 * np.sqrt(1 / 3)
    assert strategy.record_extra()["dp"]["epsilon"] == pytest.approx(epsilon([z_had], 1.0, 1e-5), rel=1e-5)


def test_the_ledger_survives_a_restart_through_the_strategy_state():
    strategy = make_strategy(SPEC)
    g = strategy.init_global()
    for r in (1, 2):
        strategy.aggregate(g, [_update("a", 0.1, tuple(g), g)], round_=r, phase="train")
    state = json.loads(json.dumps(strategy.state()))
    again = make_strategy(SPEC)
    again.load_state(state)
    assert again.record_extra() == strategy.record_extra()


def test_ftltp_clips_base_and_blocks_jointly_and_noises_each_mean():
    spec = TaskSpec(
        "tool",
        "ftltp",
        "mlp",
        model_args={"sizes": [6, 4, 3, 2]},
        hparams={"groups": {"M": 2, "S": 2}},
        server={"device_groups": {"m1": "M", "m2": "M", "s1": "S"}, "client_fraction": 0.5},
        dp={"clip": 1.0, "noise_multiplier": 1e-9},
        dtype="float64",
    )
    strategy = make_strategy(spec)
    assert strategy.privacy.ledger.sampling_rate == pytest.approx(1.0)  # group S: 1 of 1
    g = strategy.init_global()
    ups = []
    for d, grp in (("m1", "M"), ("s1", "S")):
        names = strategy.client.names_for(grp)
        ups.append(Update(d, {n: g[n] + 5.0 for n in names}, 10))
    out = strategy.aggregate(g, ups, round_=1, phase="train")
    # Each device's whole change (5 everywhere) was clipped to norm 1: 1/sqrt(size) per entry.
    entry = {d: 1 / np.sqrt(sum(g[n].size for n in u.params)) for d, u in zip(("m1", "s1"), ups, strict=True)}
    for n in strategy.client.base_names:  # over the 2 expected (one per group)
        np.testing.assert_allclose(out[n] - g[n], (entry["m1"] + entry["s1"]) / 2, atol=1e-6)
    for n in strategy.client.names_for("M"):
        if n not in strategy.client.base_names:  # over group M's 1 expected
            np.testing.assert_allclose(out[n] - g[n], entry["m1"], atol=1e-6)


def _task_toml(algorithm: str, dp: str, server: str = "", extra: str = "") -> str:
    return (
        f'[[task]]\nname = "t"\nalgorithm = "{algorithm}"\nmodel = "sigmoid_glm"\n{server}\n'
        f"[task.dp]\n{dp}\n{extra}"
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (_task_toml("fedavg", 'mode = "central"'), "needs devices_per_round"),
        (_task_toml("fedavg", 'mode = "centrl"'), "dp mode must be one of"),
        (_task_toml("fedavg", "clip = -1.0\ndevices_per_round = 2"), "clip must be a finite number > 0"),
        (_task_toml("fedavg", "sigma = 1.0"), "task[0].dp.sigma: unknown field"),
        (
            _task_toml("fedavg", "devices_per_round = 2", 'server = { reducer = "median" }'),
            "dp needs reducer 'mean'",
        ),
        (
            '[[task]]\nname = "t"\nalgorithm = "perpca"\nmodel = "perpca"\n'
            "hparams = { dim = 4, r_global = 1, r_local = 1 }\n[task.dp]\ndevices_per_round = 2\n",
            "needs a mean-family strategy",
        ),
        (
            _task_toml("fedavg", "devices_per_round = 2\nfleet_size = 20"),
            "serve does not draw devices at random",
        ),
        (
            '[collect]\nstraggler = "next_round"\n' + _task_toml("fedavg", "devices_per_round = 2"),
            "dp needs [collect] straggler = 'drop'",
        ),
    ],
)
def test_a_dp_config_mistake_is_one_line_naming_it(text, needle):
    with pytest.raises(ConfigError) as info:
        build(AggregatorConfig, tomllib.loads(text), "aggregator.toml")
    line = "; ".join(info.value.errors)
    assert needle in line, line
    assert "\n" not in line


def test_ftltp_refuses_distributed_noise_in_one_line():
    spec = TaskSpec(
        "tool",
        "ftltp",
        "mlp",
        model_args={"sizes": [6, 4, 3, 2]},
        hparams={"groups": {"M": 2, "S": 2}},
        server={"device_groups": {"m1": "M", "s1": "S"}},
        dp={"mode": "distributed", "devices_per_round": 2},
    )
    with pytest.raises(ValueError) as err:
        make_strategy(spec)
    assert all(noun in str(err.value) for noun in ("dp", "'distributed'", "ftltp")), err.value


def _clients(n: int = 3) -> dict[str, ClientData]:
    rng = np.random.default_rng(0)
    out = {}
    for i in range(n):
        x = rng.uniform(-1, 1, (24, 1))
        y = 1.0 / (1.0 + np.exp(-2 * x)) + 0.05 * rng.standard_normal((24, 1))
        out[f"p{i}"] = ClientData(Dataset(x[:16], y[:16]), Dataset(x[16:], y[16:]))
    return out


def test_a_task_stops_cleanly_at_its_epsilon_budget_and_stays_stopped(tmp_path):
    budget = epsilon([1.1] * 3, 1.0, 1e-5) + 0.01  # three rounds fit, the fourth would not
    spec = dataclasses.replace(SPEC, rounds=8, dp={**DP, "epsilon_budget": budget})
    store = SqliteStore(tmp_path / "agg.sqlite")
    store.register_task(spec.name, spec.to_json())
    engine = RoundEngine(spec, SimulatedFleet(spec, _clients()), store=store)
    engine.run()
    records = store.rounds("speed")
    assert [r.round for r in records] == [1, 2, 3]
    eps = [r.extra["dp"]["epsilon"] for r in records]
    assert eps == pytest.approx([epsilon([1.1] * k, 1.0, 1e-5) for k in (1, 2, 3)], rel=1e-5)
    assert eps[-1] <= budget and "stop" in records[-1].extra["dp"] and "stop" not in records[-2].extra["dp"]
    # A restarted aggregator resumes the ledger and runs nothing more.
    again = RoundEngine(spec, SimulatedFleet(spec, _clients()), store=store)
    again.run()
    assert len(store.rounds("speed")) == 3
    store.close()


def test_fleet_privacy_prints_each_dp_tasks_epsilon(tmp_path, capsys):
    store = SqliteStore(tmp_path / "aggregator.sqlite")
    store.register_task(SPEC.name, SPEC.to_json())
    RoundEngine(dataclasses.replace(SPEC, rounds=2), SimulatedFleet(SPEC, _clients()), store=store).run()
    store.close()
    assert cli.main(["fleet", "privacy", "--state-dir", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["task"] == "speed" and row["round"] == 2 and row["mode"] == "central"
    assert row["epsilon"] == pytest.approx(epsilon([1.1] * 2, 1.0, 1e-5), rel=1e-5)
    assert cli.main(["fleet", "privacy", "--state-dir", str(tmp_path), "--rounds"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:5] == ["task", "mode", "round", "rounds", "epsilon"] and len(table) == 3
    assert cli.main(["fleet", "privacy", "--state-dir", str(tmp_path / "none")]) == 2

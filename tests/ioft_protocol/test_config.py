"""Config schemas list every failing field at once."""

from __future__ import annotations

import pytest

from cloud_aggregator.config import AggregatorConfig
from edge.cli import config_from_args, parse_args
from edge.config import DeviceConfig
from ioft_protocol.config import ConfigError, build, load_toml


def test_every_error_is_listed():
    with pytest.raises(ConfigError) as info:
        build(DeviceConfig, {"device": "printer1", "keepalive": "x", "bogus": 1, "data": {"source": "zz"}})
    text = str(info.value)
    assert "keepalive: expected int" in text and "bogus: unknown field" in text and "data.source" in text
    assert len(info.value.errors) == 3


def test_cli_overrides_toml(tmp_path):
    cfg = tmp_path / "d.toml"
    cfg.write_text('fleet = "plant"\nbroker = "mqtt://a:1"\n[data]\nseed = 4\n')
    args = parse_args(
        ["--device", "printer3", "--config", str(cfg), "--broker", "mqtt://b:2", "--simulate", "printer"]
    )
    c = config_from_args(args)
    assert (c.device, c.fleet, c.broker, c.data.source, c.data.seed) == (
        "printer3",
        "plant",
        "mqtt://b:2",
        "simulate-printer",
        4,
    )
    assert c.state_dir == "/var/lib/ioft/printer3" and c.allow_plaintext is False


def test_bad_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("fleet = \n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_toml(bad)


def test_aggregator_tasks_are_validated_at_start():
    with pytest.raises(ConfigError, match="task name"):
        build(
            AggregatorConfig, {"task": [{"name": "Bad Name", "algorithm": "pflda", "model": "sigmoid_glm"}]}
        )
    with pytest.raises(ConfigError, match="unique"):
        t = {"name": "a", "algorithm": "pflda", "model": "sigmoid_glm"}
        build(AggregatorConfig, {"task": [t, t]})


def test_a_task_names_its_feature_schema():
    from sensors.features.schema import schema_hash

    t = {
        "name": "tool",
        "algorithm": "fedavg",
        "model": "mlp",
        "model_args": {"sizes": [624, 4]},
        "feature_schema": "weld-dwt",
    }
    cfg = build(AggregatorConfig, {"task": [t]})
    assert cfg.task[0].spec().feature_schema == schema_hash()
    assert build(AggregatorConfig, {"task": [{**t, "feature_schema": "ab" * 32}]}).task[
        0
    ].spec().feature_schema == ("ab" * 32)
    with pytest.raises(ConfigError, match="feature_schema"):
        build(AggregatorConfig, {"task": [{**t, "feature_schema": "weld-dwt-v9"}]})


# -- [admission] ----------------------------------------------------------------------------------
def test_admission_table_becomes_the_fleets_admission_policy(tmp_path):
    from cloud_aggregator.rounds.admission import AdmissionPolicy

    cfg = tmp_path / "agg.toml"
    cfg.write_text(
        'fleet = "plant"\n[admission]\nmax_norm_ratio = 50.0\nmin_history = 4\nhistory = 64\n'
        "max_update_norm = 1e3\nmax_param_norm = inf\n"
    )
    c = build(AggregatorConfig, load_toml(cfg), str(cfg))
    assert c.admission.policy() == AdmissionPolicy(
        max_norm_ratio=50.0,
        min_history=4,
        history=64,
        max_update_norm=1e3,
        max_param_norm=None,
    )
    assert build(AggregatorConfig, {}).admission.policy() == AdmissionPolicy()  # defaults unchanged
    off = build(AggregatorConfig, {"admission": {"max_norm_ratio": float("inf")}})
    assert off.admission.policy().max_norm_ratio is None  # TOML's inf: the relative bound is off


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"max_norm_ratio": 0.5}, "max_norm_ratio must be > 1"),
        ({"max_norm_ratio": float("nan")}, "max_norm_ratio must be > 1"),
        ({"max_update_norm": 0.0}, "max_update_norm must be > 0"),
        ({"max_param_norm": -1.0}, "max_param_norm must be > 0"),
        ({"min_history": 10, "history": 5}, "min_history <= history"),
        ({"min_history": 0}, "min_history <= history"),
        ({"replay_rounds": 20}, "admission.replay_rounds: unknown field"),
        ({"history": "many"}, "admission.history: expected int"),
        ({"min_history": True}, "admission.min_history: expected int"),
        ({"max_norm_ration": 5.0}, "admission.max_norm_ration: unknown field"),
    ],
)
def test_admission_table_is_validated(table, message):
    with pytest.raises(ConfigError, match=message):
        build(AggregatorConfig, {"admission": table})


def test_serve_hands_the_admission_policy_to_the_fleet(tmp_path, monkeypatch):
    """``serve`` builds ``MqttFleet`` with the configured policy (it used the defaults before)."""
    from cloud_aggregator.serve import server

    seen = {}

    class StopError(Exception):
        pass

    class FakeFleet:
        def __init__(self, session, fleet, policy, store=None, admission=None):
            seen["admission"] = admission
            self.selections: dict = {}
            self.holdouts: dict = {}

        def wait_for_devices(self):
            raise StopError

    class FakeSession:
        def start(self, timeout):
            pass

        def stop(self, final=None):
            pass

    monkeypatch.setattr(server, "open_session", lambda cfg, notifier=None: FakeSession())
    monkeypatch.setattr(server, "claim_fleet", lambda session, fleet: None)
    monkeypatch.setattr(server, "MqttFleet", FakeFleet)
    cfg = build(
        AggregatorConfig,
        {"state_dir": str(tmp_path), "admission": {"max_norm_ratio": 20.0, "max_update_norm": 5.0}},
    )
    with pytest.raises(StopError):
        server.serve(cfg)
    assert seen["admission"].max_norm_ratio == 20.0 and seen["admission"].max_update_norm == 5.0

"""A task's spec against its stored history: what keeps it, what is refused,
and that `serve` refuses a bad or changed config in one line, exit 2, before connecting."""

from __future__ import annotations

import signal

import pytest

from cloud_aggregator import cli
from cloud_aggregator.config import TaskConfig
from cloud_aggregator.local.fleet import aggregator_toml, pflda_task
from cloud_aggregator.store.sqlite import SqliteStore, TaskChangedError, changed_fields
from ioft_protocol.config import ConfigError, build

#: Nothing listens here: a serve that got as far as connecting would fail differently.
NO_BROKER = "mqtt://127.0.0.1:9"


def _spec(**changes: object) -> str:
    return build(TaskConfig, pflda_task(rounds=3) | changes).spec().to_json()


def test_more_rounds_keep_history_and_other_changes_are_named():
    assert changed_fields(_spec(), _spec(rounds=9), last_round=3) == []
    assert changed_fields(_spec(), _spec(algorithm="fedavg", seed=4), last_round=3) == ["algorithm", "seed"]
    assert changed_fields(_spec(), _spec(rounds=2), last_round=3) == ["rounds (below the 3 already run)"]


def test_store_refuses_a_changed_spec_and_changes_nothing(tmp_path):
    store = SqliteStore(tmp_path / "agg.sqlite")
    try:
        assert store.register_task("speed", _spec()) is False
        assert store.register_task("speed", _spec(rounds=5)) is True
        with pytest.raises(TaskChangedError, match=r"hparams changed.*--restart speed"):
            store.register_task("speed", _spec(hparams={"lr": 0.5}))
        assert store.task_spec("speed") == _spec(rounds=5)
        assert store.register_task("speed", _spec(hparams={"lr": 0.5}), restart=True) is False
        assert store.task_spec("speed") == _spec(hparams={"lr": 0.5})
    finally:
        store.close()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"algorithm": "pfl-da"}, "unknown algorithm 'pfl-da'; choose one of"),
        ({"model": "sigmoid"}, "unknown model 'sigmoid'; choose one of"),
        ({"hparams": {"lr": "fast"}}, "hparams: lr: expected float"),
        ({"hparams": {"lrr": 0.1}}, "unknown hyperparameters ['lrr']"),
        ({"server": {"weighting": "unif"}}, "unknown weighting 'unif'"),
    ],
)
def test_serve_refuses_a_bad_task_in_one_line_before_connecting(tmp_path, capsys, change, says):
    cfg = tmp_path / "aggregator.toml"
    cfg.write_text(aggregator_toml(NO_BROKER, tmp_path / "state", [pflda_task() | change]))
    assert cli.main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err
    assert not (tmp_path / "state" / "aggregator.sqlite").exists()  # nothing written


def test_serve_refuses_a_changed_task_in_one_line_and_the_store_is_untouched(tmp_path, capsys):
    store = SqliteStore(tmp_path / "state" / "aggregator.sqlite")
    store.register_task("speed", build(TaskConfig, pflda_task()).spec().to_json())
    store.close()
    cfg = tmp_path / "aggregator.toml"
    cfg.write_text(aggregator_toml(NO_BROKER, tmp_path / "state", [pflda_task() | {"model": "linear"}]))
    term = signal.getsignal(signal.SIGTERM)
    assert cli.main(["serve", "--config", str(cfg)]) == 2
    # serve's SIGTERM handler is its own: a study's forked workers would inherit it, ignore the
    # pool's SIGTERM and hang the suite (seen in CI).
    assert signal.getsignal(signal.SIGTERM) is term
    err = capsys.readouterr().err.strip()
    assert "model changed" in err and "serve --restart speed" in err and "\n" not in err, err
    store = SqliteStore(tmp_path / "state" / "aggregator.sqlite", readonly=True)
    assert store.task_spec("speed") == build(TaskConfig, pflda_task()).spec().to_json()
    store.close()


def test_restart_must_name_configured_tasks(tmp_path, capsys):
    cfg = tmp_path / "aggregator.toml"
    cfg.write_text(aggregator_toml(NO_BROKER, tmp_path / "state", [pflda_task()]))
    assert cli.main(["serve", "--config", str(cfg), "--restart", "tool"]) == 2
    assert "restart names tasks that are not configured: ['tool']" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        build(TaskConfig, pflda_task() | {"algorithm": "pfl-da"})

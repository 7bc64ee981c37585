"""The daemon's model wiring without a broker: config, embeddings as task features, on-device inference."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cloud_aggregator.models.push import push_messages
from edge.cli import config_from_args, parse_args
from edge.config import DeviceConfig
from edge.daemon import EdgeTrainer
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from ioft_protocol import round_messages
from ioft_protocol.config import ConfigError, build
from ioft_protocol.mqtt import topic_matches
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

SPEC = TaskSpec(
    name="speed-raw",
    algorithm="fedrep",
    model="mlp",
    model_args={"sizes": [2, 8, 1]},
    hparams={"features": "onnx:enc", "local_steps": 3, "head_steps": 3},
)


def test_model_settings_are_validated_and_set_from_the_command_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        build(DeviceConfig, {"device": "p1", "model": {"rollback_margin": 2.0, "bogus": 1}})
    assert "model.bogus: unknown field" in str(info.value)
    with pytest.raises(ConfigError, match="rollback_margin"):
        build(DeviceConfig, {"device": "p1", "model": {"rollback_margin": 2.0}})
    args = parse_args(["--device", "p1", "--simulate", "printer-raw", "--model-key", "/k/fleet.pub"])
    cfg = config_from_args(args)
    assert (cfg.data.source, cfg.model.public_key, cfg.model.window_bytes) == (
        "simulate-printer-raw",
        "/k/fleet.pub",
        1024 * 1024,
    )


def test_a_task_trains_and_predicts_on_the_active_encoders_embeddings(tmp_path):
    priv, pub = generate_keypair(tmp_path / "fleet.key")
    cfg = build(
        DeviceConfig,
        {
            "device": "printer4",
            "fleet": "plant",
            "state_dir": str(tmp_path / "printer4"),
            "allow_plaintext": True,
            "data": {"source": "simulate-printer-raw"},
            "model": {"public_key": str(pub)},
        },
    )
    trainer = EdgeTrainer(cfg)  # not started: no broker needed to exercise the wiring
    assert trainer.task_data(SPEC.to_json()) is None  # no encoder yet: the round is skipped
    retained: dict[str, bytes] = {}
    pending: list[str] = []
    trainer.session.subscribe = pending.append  # the broker would answer with the retained chunk
    trainer.session.unsubscribe = lambda topic: None
    pkg = signed(window_encoder(tmp_path / "e.onnx"), tmp_path / "pkg", load_private_key(priv), version=7)
    msgs = push_messages("plant", pkg, chunk_size=128)
    assert len(msgs) - 1 == -(-pkg.manifest.size // 128) >= 3  # the offer, then several chunks
    retained.update(msgs)
    trainer.session.publish = lambda *a, **k: None  # the status publish has no broker to go to
    trainer.handle(*msgs[0])
    while pending:  # one filter (the version's chunks streaming in), or chunk topics one by one
        subscribed = pending.pop(0)
        for topic in [t for t in retained if topic_matches(subscribed, t)]:
            trainer.handle(topic, retained[topic])  # on the daemon's thread: no network thread here
    assert trainer.models.active("enc").version == 7

    train, test, version = trainer.task_data(SPEC.to_json())
    assert version == 7 and train.x.shape == (len(trainer.train), 2) and test.x.dtype == np.float32
    assert np.array_equal(train.y, trainer.train.y)
    algo = trainer._client(SPEC.to_json())
    shared = algo.init_global(np.random.default_rng(0))
    trainer.on_announcement(
        round_messages.Announcement(
            "plant", "speed-raw", 1, "train", SPEC.to_json(), 0.0, param_hash(shared), params=shared
        )
    )
    state = trainer.tasks["speed-raw"]
    assert state.metrics["encoder_version"] == 7.0 and set(state.upload) == {"fc0.weight", "fc0.bias"}
    pred = trainer.personal_prediction("speed-raw", shared, trainer.test.x[:5])  # raw windows in, speed out
    assert pred.shape == (5, 1) and np.isfinite(pred).all()
    status = json.loads(trainer.link.status("online")[1])
    assert status["models"]["enc"]["active"] == 7 and status["tasks"]["speed-raw"]["round"] == 1

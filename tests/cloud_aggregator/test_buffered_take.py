"""FedBuff over MQTT, without a broker: the job a device took itself is recovered from its upload
(:meth:`BufferedServer.take`), a restart resumes from a stored version, the config's
``mode = "buffered"`` and the announcement's ``mode`` field."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from cloud_aggregator.aggregation.fedbuff import Arrival, BufferConfig
from cloud_aggregator.config import MAX_STALENESS, AggregatorConfig, TaskConfig
from cloud_aggregator.rounds.buffered import BufferedServer
from cloud_aggregator.rounds.types import Reason, Refusal
from ioft_protocol import codec
from ioft_protocol.config import ConfigError, build
from ioft_protocol.round_messages import Announcement, UpdateMessage
from tests.cloud_aggregator.test_fedbuff import SPEC, shifted


def pulled(server: BufferedServer, device: str, round_: int, shift: float = 0.1) -> UpdateMessage:
    """An upload trained from the current global (as a device that read the retained announcement)."""
    _, params, digest = server.current()
    return UpdateMessage(
        "sim", SPEC.name, device, round_, server.phase, 10, digest, {}, shifted(params, shift)
    )


def test_take_recovers_the_job_and_refuses_replays_and_unknown_globals() -> None:
    server = BufferedServer(SPEC, BufferConfig(k=2, max_staleness=1), keep_recent=2)
    first = pulled(server, "a", 1)
    assert isinstance(server.take("a", first), Arrival)
    assert server.take("a", first).reason == Reason.REPLAY  # a QoS 1 copy
    assert server.take("b", pulled(server, "b", 0)).reason == Reason.STALE_ROUND  # round before version + 1
    forged = UpdateMessage(**{**pulled(server, "c", 1).__dict__, "global_hash": "f" * 64})
    assert server.take("c", forged).reason == Reason.WRONG_GLOBAL
    bad = pulled(server, "d", 1)
    bad = UpdateMessage(**{**bad.__dict__, "params": {"decoder.weight": np.zeros((2, 2), np.float32)}})
    assert server.take("d", bad).reason == Reason.SHAPE_DTYPE  # the admission pipeline's step
    applied = server.take("d", pulled(server, "d", 1))  # its fixed resend of the same job
    assert isinstance(applied, Arrival) and applied.applied and server.version == 1
    led = server.ledger()
    assert led["arrived"] == led["buffered"] + led["too_stale"] + led["refused"]
    assert led["dispatched"] == led["buffered"] + led["too_stale"] + led["abandoned"] + led["outstanding"]


def test_an_upload_past_max_staleness_is_refused_with_its_age_and_counted_too_stale() -> None:
    server = BufferedServer(SPEC, BufferConfig(k=1, max_staleness=2), keep_recent=3)
    slow = pulled(server, "slow", 1)
    weights = []
    for r in range(1, 4):
        weights.append(server.take("fast", pulled(server, "fast", r)).weight)
    assert weights == [1.0, 1.0, 1.0] and server.version == 3
    refused = server.take("slow", slow)
    assert isinstance(refused, Refusal) and refused.reason == Reason.STALE_ROUND
    assert "3 versions old > max_staleness 2" in refused.detail
    assert server.admission.refused["slow"] == {Reason.STALE_ROUND: 1}
    led = server.ledger()
    assert (led["too_stale"], led["buffered"]) == (1, 3)
    assert led["dispatched"] == led["buffered"] + led["too_stale"] + led["abandoned"] + led["outstanding"]
    late = pulled(server, "slow", 4)  # from version 3 now (round >= version + 1); one step later: 1 old
    server.take("fast", pulled(server, "fast", 4))
    arrival = server.take("slow", late)
    assert (arrival.staleness, arrival.weight) == (1, pytest.approx(2**-0.5))


def test_resume_judges_uploads_from_the_stored_recent_versions() -> None:
    first = BufferedServer(SPEC, BufferConfig(k=1, max_staleness=3), keep_recent=4)
    history = {0: first.current()[1]}
    old = pulled(first, "slow", 1)
    for r in range(1, 3):
        first.take("fast", pulled(first, "fast", r))
        history[first.version] = first.current()[1]
    again = BufferedServer(SPEC, BufferConfig(k=1, max_staleness=3), keep_recent=4)
    again.resume(first.version, first.global_params, history)
    assert again.version == 2 and again.current()[2] == first.current()[2]
    arrival = again.take("slow", old)  # trained from version 0 before the restart
    assert isinstance(arrival, Arrival) and arrival.staleness == 2 and arrival.applied
    assert again.version == 3


def task(**fields) -> TaskConfig:
    return build(TaskConfig, {"name": "s", "algorithm": "pflda", "model": "sigmoid_glm", **fields})


def test_config_mode_buffered_and_its_refusals() -> None:
    cfg = task(mode="buffered", buffered={"k": 3, "server_lr": 0.5}).buffer_config()
    assert cfg == BufferConfig(k=3, server_lr=0.5, staleness="sqrt", max_staleness=MAX_STALENESS)
    for fields, match in (
        ({"mode": "fast"}, "mode must be one of"),
        ({"buffered": {"k": 3}}, "needs mode = 'buffered'"),
        ({"mode": "buffered", "buffered": {"k": 0}}, "buffer_k must be >= 1"),
        ({"mode": "buffered", "holdout": ["p1"]}, "leave holdout out"),
        ({"mode": "buffered", "algorithm": "fedpp"}, "weighted mean"),
    ):
        with pytest.raises(ConfigError, match=match):
            task(**fields)


def test_the_readme_buffered_task_validates() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "scale.md").read_text()
    (body,) = re.findall(r"```toml\n# README example: buffered-task.toml\n(.*?)```", text, re.S)
    cfg = build(AggregatorConfig, {"allow_plaintext": True, **tomllib.loads(body)}, "README buffered task")
    (task_cfg,) = cfg.task
    assert task_cfg.mode == "buffered" and task_cfg.buffer_config() == BufferConfig(10, 1.0, "sqrt", 20)


def test_the_announcement_carries_the_mode_only_when_buffered() -> None:
    ann = Announcement("f", "t", 3, "train", "{}", 1.0, "h", mode="buffered")
    assert Announcement.decode(ann.encode()).mode == "buffered"
    sync = Announcement("f", "t", 3, "train", "{}", 1.0, "h")
    assert b"mode" not in sync.encode() and Announcement.decode(sync.encode()).mode == "sync"
    meta, tensors = codec.decode(ann.encode())
    fields = {k: v for k, v in meta.items() if k not in ("v", "kind")} | {"mode": "async"}
    with pytest.raises(codec.WireError, match="round mode"):
        Announcement.decode(codec.encode("round", fields, tensors))

"""The device's model manager on real ONNX files and real onnxruntime, without a broker.

A ``Retained`` fake stands in for the broker's retained store: the manager subscribes
to chunk topics and gets what is stored there, as mosquitto would deliver it.
No torch anywhere on this path.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from cloud_aggregator.models.push import push_messages
from edge.config import DataConfig, ModelConfig
from edge.models.manager import ModelManager
from edge.simulated import simulated_printer_raw_dataset
from export.keys import generate_keypair, load_private_key, sign
from export.synthetic import signed, window_encoder
from ioft_protocol import model_push, topics
from ioft_protocol.manifest import load_public_key
from sensors.features.schema import schema_hash

FLEET = "plant"
CHUNK = 4096


class Retained:
    """The broker's retained messages and one client's subscriptions, with MQTT's delivery rules:
    a subscription gets the topic's retained message once; a publish reaches current subscribers."""

    def __init__(self) -> None:
        self.store: dict[str, bytes] = {}
        self.subs: list[str] = []
        self.pending: list[str] = []
        self.peak_subs = 0
        self.delivered = 0

    def publish_all(self, messages: list[tuple[str, bytes]]) -> bytes:
        """Store ``messages`` (retained) and queue them for current subscribers; returns the offer."""
        for topic, payload in messages:
            self.store[topic] = payload
            if topic in self.subs:
                self.pending.append(topic)
        return messages[0][1]

    def subscribe(self, topic: str) -> None:
        self.subs.append(topic)
        self.pending.append(topic)
        self.peak_subs = max(self.peak_subs, len(self.subs))

    def unsubscribe(self, topic: str) -> None:
        self.subs.remove(topic)

    def pump(self, mgr: ModelManager, limit: int | None = None) -> None:
        """Deliver what is due, in order, until nothing is (or ``limit`` deliveries in all)."""
        while self.pending and (limit is None or self.delivered < limit):
            topic = self.pending.pop(0)
            if topic not in self.subs or topic not in self.store:
                continue
            parsed = topics.parse_topic(topic)
            self.delivered += 1
            mgr.handle_chunk(parsed.model, parsed.version, parsed.index, self.store[topic])


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    priv, pub = generate_keypair(folder / "fleet.key")
    other, _ = generate_keypair(folder / "other.key")
    return load_private_key(priv), load_public_key(pub), load_private_key(other)


@pytest.fixture(scope="module")
def holdout():
    train, test, meta = simulated_printer_raw_dataset("printer7", DataConfig(source="simulate-printer-raw"))
    return train, test, meta["schema_hash"]


def make_manager(root: Path, keys, holdout, retained: Retained, **cfg) -> ModelManager:
    _, public, _ = keys
    train, test, schema = holdout
    config = replace(ModelConfig(public_key="unused"), window_bytes=4 * CHUNK, **cfg)
    return ModelManager(
        root,
        config,
        device="printer7",
        fleet=FLEET,
        public_key=public,
        data_schema_hash=schema,
        holdout=(train, test),
        subscribe=retained.subscribe,
        unsubscribe=retained.unsubscribe,
    )


def offer_and_fetch(mgr: ModelManager, retained: Retained, package, **kw) -> bool:
    offer = retained.publish_all(push_messages(FLEET, package, chunk_size=CHUNK, **kw))
    changed = mgr.handle_offer(package.manifest.name, offer)
    retained.pump(mgr)
    return changed


def last_reason(mgr: ModelManager, name: str = "enc") -> str:
    return mgr.status()[name]["rejected"][-1]["reason"]


def test_a_pushed_encoder_is_fetched_in_a_bounded_window_verified_and_activated(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained)
    pkg = signed(window_encoder(tmp_path / "a.onnx", pad_bytes=60_000), tmp_path / "pkg", key, version=1)
    assert offer_and_fetch(mgr, retained, pkg)
    status = mgr.status()["enc"]
    assert status["active"] == 1 and status["previous"] is None
    assert status["metric_name"] == "probe_r2" and status["metric"] > 0.5
    n_chunks = -(-pkg.manifest.size // CHUNK)
    assert n_chunks >= 14 and retained.delivered == n_chunks
    assert retained.peak_subs == 4  # window_bytes // chunk size: memory bound of the transfer
    assert retained.subs == []  # every chunk subscription was dropped once the chunk landed
    model = mgr.active("enc")
    assert model.run(holdout[1].x[:5]).shape == (5, 2)
    assert (tmp_path / "models" / "enc" / "v1.onnx").read_bytes() == pkg.onnx_path.read_bytes()
    assert not list((tmp_path / "models" / "enc" / "incoming").glob("*.part"))
    # The same retained offer again (a reconnect) changes nothing.
    assert not mgr.handle_offer("enc", retained.store[topics.topic_model_offer(FLEET, "enc")])


def test_wrong_key_altered_manifest_and_wrong_schema_are_refused_before_any_fetch(tmp_path, keys, holdout):
    key, _, other = keys
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained)
    good = signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "pkg", key, version=1)
    offer_and_fetch(mgr, retained, good)

    forged = signed(window_encoder(tmp_path / "b.onnx"), tmp_path / "forged", other, version=2)
    offer_and_fetch(mgr, retained, forged)
    assert "signature does not verify" in last_reason(mgr)
    assert mgr.status()["enc"]["rejected"][-1]["version"] == 2

    genuine = signed(window_encoder(tmp_path / "c.onnx", pad_bytes=100), tmp_path / "alt", key, version=3)
    msgs = push_messages(FLEET, genuine, chunk_size=CHUNK)
    offer = model_push.ModelOffer.decode(msgs[0][1])
    altered = replace(offer, manifest=offer.manifest.replace('"version":3', '"version":4'))
    assert altered.manifest != offer.manifest
    mgr.handle_offer("enc", altered.encode())
    assert "signature does not verify" in last_reason(mgr)

    other_schema = window_encoder(tmp_path / "d.onnx", schema_hash=schema_hash())  # the welders' DWT schema
    offer_and_fetch(mgr, retained, signed(other_schema, tmp_path / "dwt", key, version=5))
    assert "feature schema" in last_reason(mgr)

    assert retained.delivered == -(-good.manifest.size // CHUNK)  # nothing refused was fetched
    assert mgr.status()["enc"]["active"] == 1 and mgr.active("enc").version == 1
    persisted = json.loads((tmp_path / "models" / "enc" / "rejections.json").read_text())
    assert [r["version"] for r in persisted] == [2, 4, 5]  # the altered one as it claims to be


def test_tampered_and_truncated_chunks_are_refused_and_the_old_model_keeps_serving(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained)
    offer_and_fetch(
        mgr, retained, signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "p1", key, version=1)
    )

    v2 = signed(window_encoder(tmp_path / "b.onnx", pad_bytes=20_000), tmp_path / "p2", key, version=2)
    msgs = push_messages(FLEET, v2, chunk_size=CHUNK)
    topic, payload = msgs[2]
    chunk = model_push.ModelChunk.decode(payload, max_bytes=CHUNK)
    flipped = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
    msgs[2] = (topic, replace(chunk, data=flipped).encode())  # self-consistent, but not what was signed
    mgr.handle_offer("enc", retained.publish_all(msgs))
    retained.pump(mgr)
    assert "altered in transit" in last_reason(mgr)
    assert retained.subs == [] and not list((tmp_path / "models" / "enc" / "incoming").glob("*.part"))

    v3 = signed(window_encoder(tmp_path / "c.onnx", pad_bytes=20_000), tmp_path / "p3", key, version=3)
    msgs = push_messages(FLEET, v3, chunk_size=CHUNK)
    topic, payload = msgs[1]
    msgs[1] = (topic, payload[: len(payload) // 2])
    mgr.handle_offer("enc", retained.publish_all(msgs))
    retained.pump(mgr)
    assert "malformed model chunk" in last_reason(mgr)
    assert mgr.active("enc").version == 1
    assert sorted(p.name for p in (tmp_path / "models" / "enc").glob("*.onnx")) == ["v1.onnx"]


def test_a_signed_but_truncated_file_fails_its_smoke_test(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained)
    offer_and_fetch(
        mgr, retained, signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "p1", key, version=1)
    )
    whole = signed(window_encoder(tmp_path / "b.onnx", pad_bytes=4000), tmp_path / "p2", key, version=2)
    data = whole.onnx_path.read_bytes()[:2500]  # cut by a faulty copy before signing
    whole.onnx_path.write_bytes(data)
    manifest = replace(whole.manifest, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    text = manifest.to_json()
    offer_and_fetch(mgr, retained, replace(whole, manifest_json=text, signature=sign(text, key)))
    assert "failed its smoke test" in last_reason(mgr) and "v1 keeps serving" in last_reason(mgr)
    assert mgr.active("enc").version == 1


def test_a_version_whose_holdout_score_drops_is_rolled_back(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained, rollback_margin=0.05)
    offer_and_fetch(
        mgr, retained, signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "p1", key, version=1)
    )
    good = mgr.status()["enc"]["metric"]
    offer_and_fetch(
        mgr,
        retained,
        signed(window_encoder(tmp_path / "b.onnx", kind="mean"), tmp_path / "p2", key, version=2),
    )
    reason = last_reason(mgr)
    assert "below active v1" in reason and "rolled back to v1" in reason
    assert mgr.status()["enc"]["active"] == 1 and mgr.status()["enc"]["metric"] == good
    assert json.loads((tmp_path / "models" / "enc" / "active.json").read_text())["version"] == 1
    assert not (tmp_path / "models" / "enc" / "v2.onnx").exists()
    # A better version still goes through, and the old one is kept as the previous.
    offer_and_fetch(
        mgr,
        retained,
        signed(window_encoder(tmp_path / "c.onnx", pad_bytes=8), tmp_path / "p3", key, version=3),
    )
    assert mgr.status()["enc"]["active"] == 3 and mgr.status()["enc"]["previous"] == 1


def test_a_restarted_device_resumes_with_the_chunks_it_has(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    root = tmp_path / "models"
    mgr = make_manager(root, keys, holdout, retained)
    pkg = signed(window_encoder(tmp_path / "a.onnx", pad_bytes=80_000), tmp_path / "p", key, version=1)
    offer = retained.publish_all(push_messages(FLEET, pkg, chunk_size=CHUNK))
    mgr.handle_offer("enc", offer)
    retained.pump(mgr, limit=9)
    assert mgr.status()["enc"]["transfer"] == {"version": 1, "have": 9, "of": -(-pkg.manifest.size // CHUNK)}
    mgr.close()  # the process dies here; its sparse part file stays

    retained2 = Retained()
    retained2.store = retained.store
    mgr2 = make_manager(root, keys, holdout, retained2)
    mgr2.handle_offer("enc", offer)  # the broker re-delivers the retained offer on reconnect
    retained2.pump(mgr2)
    status = mgr2.status()["enc"]
    assert status["active"] == 1
    assert status["last_transfer"]["resumed_chunks"] == 9
    assert retained2.delivered == status["last_transfer"]["chunks"] - 9  # only what it lacked


def test_start_up_rolls_back_when_the_active_file_is_corrupted(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    root = tmp_path / "models"
    mgr = make_manager(root, keys, holdout, retained)
    offer_and_fetch(
        mgr, retained, signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "p1", key, version=1)
    )
    offer_and_fetch(
        mgr,
        retained,
        signed(window_encoder(tmp_path / "b.onnx", pad_bytes=64), tmp_path / "p2", key, version=2),
    )
    assert mgr.status()["enc"]["active"] == 2
    mgr.close()
    path = root / "enc" / "v2.onnx"
    path.write_bytes(path.read_bytes()[:-10])
    mgr2 = make_manager(root, keys, holdout, Retained())
    status = mgr2.status()["enc"]
    assert status["active"] == 1 and mgr2.active("enc").version == 1
    assert "fails at start-up" in last_reason(mgr2) and "rolled back to v1" in last_reason(mgr2)


def test_what_this_device_cannot_run_or_was_not_addressed_is_not_fetched(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained, max_opset=16)
    offer_and_fetch(
        mgr, retained, signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "p1", key, version=1)
    )
    assert "opset 17" in last_reason(mgr) and mgr.active("enc") is None
    pkg = signed(window_encoder(tmp_path / "b.onnx", opset=16), tmp_path / "p2", key, version=2)
    assert not offer_and_fetch(mgr, retained, pkg, devices=["printer1", "printer2"])
    assert mgr.active("enc") is None and retained.delivered == 0
    offer_and_fetch(mgr, retained, pkg, devices=["printer7"])
    assert mgr.active("enc").version == 2


def test_a_stalled_transfer_is_abandoned_and_reported(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    now = [0.0]
    _, public, _ = keys
    train, test, schema = holdout
    mgr = ModelManager(
        tmp_path / "models",
        replace(ModelConfig(public_key="unused"), window_bytes=CHUNK, transfer_timeout_s=30.0),
        device="printer7",
        fleet=FLEET,
        public_key=public,
        data_schema_hash=schema,
        holdout=(train, test),
        subscribe=retained.subscribe,
        unsubscribe=retained.unsubscribe,
        clock=lambda: now[0],
    )
    pkg = signed(window_encoder(tmp_path / "a.onnx", pad_bytes=20_000), tmp_path / "p", key, version=1)
    msgs = push_messages(FLEET, pkg, chunk_size=CHUNK)
    del msgs[4]  # the pusher died before this chunk (#3) reached the broker
    mgr.handle_offer("enc", retained.publish_all(msgs))
    retained.pump(mgr)
    assert mgr.status()["enc"]["transfer"]["have"] == 3
    now[0] = 31.0
    assert mgr.tick()
    assert "stalled at 3 of" in last_reason(mgr) and retained.subs == []


def test_stale_chunks_of_an_earlier_push_of_the_same_version_are_skipped(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained)
    first = signed(
        window_encoder(tmp_path / "a.onnx", pad_bytes=20_000, seed=1), tmp_path / "p1", key, version=1
    )
    retained.publish_all(push_messages(FLEET, first, chunk_size=CHUNK))  # an earlier push nobody fetched
    again = signed(
        window_encoder(tmp_path / "b.onnx", pad_bytes=20_000, seed=2), tmp_path / "p2", key, version=1
    )
    msgs = push_messages(FLEET, again, chunk_size=CHUNK)
    mgr.handle_offer("enc", msgs[0][1])  # the new offer lands before its chunks (offer-first push)
    retained.pump(mgr)
    assert mgr.status()["enc"]["transfer"]["have"] == 0 and "rejected" not in mgr.status()["enc"]
    retained.publish_all(msgs)
    retained.pump(mgr)
    assert mgr.active("enc").manifest.sha256 == again.manifest.sha256

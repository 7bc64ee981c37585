"""A model fetch whose chunks stream in on one subscription and are written on the network thread.

``Broker`` stands in for the broker and the device's MQTT session: retained messages,
subscriptions (topic filters), the session's taps (``MqttSession.tap``: a filter's messages
go to a callback on the network thread, or on to the daemon's queue where it returns
``False``), and the daemon's queue.  ``wildcard_retained=False`` is RabbitMQ's rule: no
retained message for a subscription with a wildcard.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cloud_aggregator.models.push import push_messages
from edge.config import DataConfig, ModelConfig
from edge.models.fetch import STREAM_QUIET_S
from edge.models.manager import ModelManager
from edge.simulated import simulated_printer_raw_dataset
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from ioft_protocol import model_push, topics
from ioft_protocol.manifest import load_public_key
from ioft_protocol.mqtt import topic_matches
from ioft_protocol.mqtt_inbound import Message

FLEET = "plant"
CHUNK = 4096


class Broker:
    def __init__(self, *, wildcard_retained: bool = True) -> None:
        self.wildcard_retained = wildcard_retained
        self.store: dict[str, bytes] = {}
        self.subs: list[str] = []
        self.taps: dict[str, object] = {}
        self.queue: list[tuple[str, bytes]] = []  # declined by a tap: the daemon's thread handles them
        self.subscribed: list[str] = []  # every SUBSCRIBE, in order
        self.pending: list[str] = []  # retained messages due to a new subscription, sent by pump()
        self.peak_subs = 0
        self.on_network_thread = 0
        self.peak_queue = 0

    # the session's side
    def subscribe(self, topic: str) -> None:
        self.subs.append(topic)
        self.subscribed.append(topic)
        self.peak_subs = max(self.peak_subs, len(self.subs))
        if "+" not in topic or self.wildcard_retained:
            self.pending.extend(t for t in self.store if topic_matches(topic, t))

    def unsubscribe(self, topic: str) -> None:
        self.subs.remove(topic)

    def tap(self, topic: str, callback) -> None:
        if callback is None:
            self.taps.pop(topic, None)
        else:
            self.taps[topic] = callback

    # the broker's side
    def publish(self, topic: str, payload: bytes) -> None:
        self.store[topic] = payload
        if any(topic_matches(s, topic) for s in self.subs):
            self.deliver(topic, payload)

    def deliver(self, topic: str, payload: bytes) -> None:
        tap = next((cb for f, cb in self.taps.items() if topic_matches(f, topic)), None)
        if tap is not None and tap(Message(topic, payload, True)) is not False:
            self.on_network_thread += 1
            return
        self.queue.append((topic, payload))
        self.peak_queue = max(self.peak_queue, len(self.queue))

    def drain(self, mgr: ModelManager) -> None:
        """The retained messages due (network thread), and what the taps passed on (the daemon's thread)."""
        while self.pending or self.queue:
            if self.pending:
                topic = self.pending.pop(0)
                if any(topic_matches(s, topic) for s in self.subs):
                    self.deliver(topic, self.store[topic])
                continue
            topic, payload = self.queue.pop(0)
            parsed = topics.parse_topic(topic)
            mgr.handle_chunk(parsed.model, parsed.version, parsed.index, payload)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    priv, pub = generate_keypair(folder / "fleet.key")
    return load_private_key(priv), load_public_key(pub)


@pytest.fixture(scope="module")
def holdout():
    train, test, meta = simulated_printer_raw_dataset("printer7", DataConfig(source="simulate-printer-raw"))
    return train, test, meta["schema_hash"]


def make_manager(root, keys, holdout, broker: Broker, clock=None) -> ModelManager:
    train, test, schema = holdout
    return ModelManager(
        root,
        replace(ModelConfig(public_key="unused"), window_bytes=4 * CHUNK),
        device="printer7",
        fleet=FLEET,
        public_key=keys[1],
        data_schema_hash=schema,
        holdout=(train, test),
        subscribe=broker.subscribe,
        unsubscribe=broker.unsubscribe,
        tap=broker.tap,
        **({"clock": clock} if clock else {}),
    )


def push(broker: Broker, mgr: ModelManager, messages, *, before: int = 0) -> None:
    """The offer, ``before`` chunks published before the device has it, then the rest, live."""
    (offer_topic, offer), chunks = messages[0], messages[1:]
    broker.store[offer_topic] = offer
    for topic, payload in chunks[:before]:
        broker.publish(topic, payload)
    mgr.handle_offer(topics.parse_topic(offer_topic).model, offer)
    broker.drain(mgr)
    for topic, payload in chunks[before:]:
        broker.publish(topic, payload)
    broker.drain(mgr)


def test_chunks_stream_in_on_one_subscription_and_are_written_on_the_network_thread(tmp_path, keys, holdout):
    broker = Broker()
    mgr = make_manager(tmp_path / "models", keys, holdout, broker)
    pkg = signed(window_encoder(tmp_path / "a.onnx", pad_bytes=60_000), tmp_path / "pkg", keys[0], version=1)
    msgs = push_messages(FLEET, pkg, chunk_size=CHUNK)
    push(broker, mgr, msgs, before=5)  # some retained before the device subscribed, the rest live
    n = len(msgs) - 1
    assert n >= 14 and mgr.status()["enc"]["active"] == 1
    assert broker.subscribed == [topics.topic_model_chunk(FLEET, "enc", 1, 0).rpartition("/")[0] + "/+"]
    assert broker.on_network_thread == n - 1  # every chunk but the last, which finishes the file
    assert broker.peak_queue == 1  # the device held one chunk at a time
    assert broker.subs == [] and broker.taps == {}
    assert (tmp_path / "models" / "enc" / "v1.onnx").read_bytes() == pkg.onnx_path.read_bytes()
    assert mgr.status()["enc"]["last_transfer"]["resumed_chunks"] == 0


def test_what_the_stream_misses_is_fetched_a_window_at_a_time_once_it_goes_quiet(tmp_path, keys, holdout):
    broker = Broker(wildcard_retained=False)  # RabbitMQ: the chunks already out never come on the stream
    now = [0.0]
    mgr = make_manager(tmp_path / "models", keys, holdout, broker, clock=lambda: now[0])
    pkg = signed(window_encoder(tmp_path / "a.onnx", pad_bytes=60_000), tmp_path / "pkg", keys[0], version=1)
    msgs = push_messages(FLEET, pkg, chunk_size=CHUNK)
    n = len(msgs) - 1
    push(broker, mgr, msgs, before=6)
    assert mgr.status()["enc"]["transfer"]["have"] == n - 6 and mgr.active("enc") is None
    now[0] = STREAM_QUIET_S / 2
    mgr.tick()
    assert len(broker.subscribed) == 1  # not quiet long enough yet
    now[0] = STREAM_QUIET_S + 0.1
    mgr.tick()
    broker.drain(mgr)
    assert mgr.status()["enc"]["active"] == 1
    assert len(broker.subscribed) == 1 + 6  # only the missing ones
    assert broker.peak_subs == 4  # a window (window_bytes // chunk size) at a time
    assert broker.subs == [] and broker.taps == {}
    assert (tmp_path / "models" / "enc" / "v1.onnx").read_bytes() == pkg.onnx_path.read_bytes()


def test_an_altered_chunk_in_the_stream_is_refused_and_the_stream_dropped(tmp_path, keys, holdout):
    broker = Broker()
    mgr = make_manager(tmp_path / "models", keys, holdout, broker)
    pkg = signed(window_encoder(tmp_path / "a.onnx", pad_bytes=30_000), tmp_path / "pkg", keys[0], version=1)
    msgs = push_messages(FLEET, pkg, chunk_size=CHUNK)
    topic, payload = msgs[3]
    chunk = model_push.ModelChunk.decode(payload, max_bytes=CHUNK)
    msgs[3] = (topic, replace(chunk, data=bytes([chunk.data[0] ^ 1]) + chunk.data[1:]).encode())
    push(broker, mgr, msgs)
    status = mgr.status()["enc"]
    assert "altered in transit" in status["rejected"][-1]["reason"] and status["active"] is None
    assert broker.subs == [] and broker.taps == {}
    assert not list((tmp_path / "models" / "enc" / "incoming").glob("*.part"))


def test_a_resumed_fetch_asks_only_for_what_it_lacks(tmp_path, keys, holdout):
    broker = Broker()
    root = tmp_path / "models"
    mgr = make_manager(root, keys, holdout, broker)
    pkg = signed(window_encoder(tmp_path / "a.onnx", pad_bytes=60_000), tmp_path / "pkg", keys[0], version=1)
    msgs = push_messages(FLEET, pkg, chunk_size=CHUNK)
    n = len(msgs) - 1
    mgr.handle_offer("enc", msgs[0][1])
    for topic, payload in msgs[1:8]:
        broker.publish(topic, payload)
    mgr.close()  # the process dies; its sparse part file stays

    broker2 = Broker()
    broker2.store = dict(msgs[1:])
    mgr2 = make_manager(root, keys, holdout, broker2)
    mgr2.handle_offer("enc", msgs[0][1])
    broker2.drain(mgr2)
    status = mgr2.status()["enc"]
    assert status["active"] == 1 and status["last_transfer"]["resumed_chunks"] == 7
    assert len(broker2.subscribed) == n - 7 and all("+" not in t for t in broker2.subscribed)
    assert broker2.subs == [] and broker2.taps == {}

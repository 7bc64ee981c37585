"""Aggregator workers without a broker: merged partial sums, the batch wire, and two workers and
their coordinator on an in-process bus that shares the uplink like ``$share`` does (round robin).

The coordinator's round must hold exactly the single aggregator's uploads: each device once
(a re-send admitted by the other worker is counted as a replay, not twice), refusals counted
and stored with their reasons, and a mean bit-identical to one fold of the same uploads.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict, deque

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.streaming import StreamingMean
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.rounds.admission import AdmissionPolicy
from cloud_aggregator.rounds.types import CollectRequest, Rejection
from cloud_aggregator.serve import worker_wire as wire
from cloud_aggregator.serve.coordinator import WorkerFleet
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy
from cloud_aggregator.serve.workers import AggregatorWorker
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import codec, round_messages, topics
from ioft_protocol.config import ConfigError, build
from ioft_protocol.mqtt_inbound import Message
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

FLEET, TASK = "f", "t"
DEVICES = [f"d{i}" for i in range(12)]
SPEC = TaskSpec(TASK, "fedavg", "sigmoid_glm", rounds=3, server={"weighting": "samples"})


def uploads(seed: int, n: int) -> list[tuple[dict[str, np.ndarray], int]]:
    rng = np.random.default_rng(seed)
    return [
        ({"w": rng.standard_normal(50).astype(np.float32), "b": rng.standard_normal(1).astype(np.float32)}, w)
        for w in rng.integers(1, 500, n)
    ]


def test_merged_partials_equal_one_fold_bit_for_bit():
    ups = uploads(0, 40)
    whole = StreamingMean()
    for params, w in ups:
        whole.add(params, w)
    order = np.random.default_rng(1).permutation(len(ups))
    merged = StreamingMean()
    for part in np.array_split(order, 3):  # three workers, each its own arrival order
        partial = StreamingMean()
        for i in part:
            partial.add(*ups[i])
        merged.merge(partial)
    assert merged.count == whole.count and merged.total_weight == whole.total_weight
    for name, value in whole.result().items():
        assert merged.result()[name].dtype == value.dtype
        assert np.array_equal(merged.result()[name], value)


def test_merge_refuses_other_names_and_shapes():
    a, b = StreamingMean(), StreamingMean()
    a.add({"w": np.zeros(3, np.float32)}, 1)
    b.add({"w": np.zeros(4, np.float32)}, 1)
    with pytest.raises(ValueError, match="shape"):
        a.merge(b)
    c = StreamingMean()
    c.add({"v": np.zeros(3, np.float32)}, 1)
    with pytest.raises(ValueError, match="names"):
        a.merge(c)


def test_a_batch_round_trips_and_garbage_is_a_wire_error():
    mean = StreamingMean()
    mean.add({"w": np.arange(3, dtype=np.float32)}, 2)
    batch = wire.Batch(
        "w1",
        7,
        TASK,
        3,
        "train",
        "ab" * 32,
        mean,
        {"d1": (2, {"loss": 0.5})},
        [(TASK, 3, "d2", "norm", "big")],
        4,
    )
    back = wire.Batch.decode(batch.encode())
    assert (back.worker, back.seq, back.round, back.flush, back.folded, back.refused) == (
        "w1",
        7,
        3,
        4,
        {"d1": (2, {"loss": 0.5})},
        [(TASK, 3, "d2", "norm", "big")],
    )
    assert np.array_equal(back.mean.result()["w"], mean.result()["w"])
    with pytest.raises(ValueError):
        wire.Batch.decode(b"not a batch")


def test_agg_topics_parse():
    assert wire.parse(wire.topic_batch(FLEET, TASK, "w1"), FLEET) == wire.AggTopic("batch", "w1", TASK)
    assert wire.parse(wire.topic_worker(FLEET, "w2"), FLEET) == wire.AggTopic("worker", "w2")
    assert wire.parse(wire.topic_ctl(FLEET), FLEET) == wire.AggTopic("ctl")
    assert wire.parse(topics.topic_up(FLEET, TASK, "d1"), FLEET) is None
    assert wire.parse(wire.topic_batch("g", TASK, "w1"), FLEET) is None  # another fleet's
    assert wire.topic_uplinks_shared(FLEET) == f"$share/{wire.GROUP}/ioft/v1/{FLEET}/task/+/up/+"


@pytest.mark.parametrize("server", [{"reducer": "median"}, {"reducer": "krum"}])
def test_workers_refuse_a_strategy_that_needs_every_update_in_one_line(server):
    raw = {
        "collect": {"workers": 2},
        "task": [{"name": "m", "algorithm": "fedavg", "model": "sigmoid_glm", "server": server}],
    }
    with pytest.raises(ConfigError) as caught:
        build(AggregatorConfig, raw, "aggregator.toml")
    text = "; ".join(caught.value.errors)
    assert "workers = 2" in text and "needs all of a round's updates" in text and "\n" not in text
    build(AggregatorConfig, {**raw, "collect": {"workers": 1}}, "aggregator.toml")  # alone it runs


# -- two workers and a coordinator on an in-process bus -------------------------------------------
def matches(pattern: str, topic: str) -> bool:
    p, t = pattern.split("/"), topic.split("/")
    return len(p) == len(t) and all(a in ("+", b) for a, b in zip(p, t, strict=True))


class Bus:
    """Topic filters with ``+``; ``$share/<group>/<filter>`` hands each message to one member in turn."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: list[BusSession] = []
        self.retained: dict[str, bytes] = {}
        self.turn: dict[str, itertools.count] = defaultdict(itertools.count)

    def publish(self, topic: str, payload: bytes, retain: bool) -> None:
        with self.lock:
            if retain:
                self.retained[topic] = payload
            shared: dict[str, list[BusSession]] = defaultdict(list)
            for s in self.sessions:
                for f in list(s.subs):
                    if f.startswith("$share/"):
                        _, group, real = f.split("/", 2)
                        if matches(real, topic):
                            shared[group + real].append(s)
                    elif matches(f, topic):
                        s.inbox.append(Message(topic, payload, retain))
                        break
            for key, members in shared.items():
                members[next(self.turn[key]) % len(members)].inbox.append(Message(topic, payload, False))


class BusSession:
    """Just enough of ``MqttSession`` for ``MqttFleet`` and the worker."""

    def __init__(self, bus: Bus) -> None:
        self.bus, self.subs, self.inbox = bus, set(), deque()
        self.on_connect_hooks: list = []
        self.connected = threading.Event()  # never "connected": no roll call on construction
        bus.sessions.append(self)

    def subscribe(self, topic: str, qos: int = 1) -> None:
        self.subs.add(topic)
        with self.bus.lock:
            for t, payload in self.bus.retained.items():
                if matches(topic, t):
                    self.inbox.append(Message(t, payload, True))

    def unsubscribe(self, topic: str) -> None:
        self.subs.discard(topic)

    def publish(self, topic, payload, *, qos=1, retain=False, timeout=None) -> None:
        self.bus.publish(topic, payload, retain)

    def get(self, timeout):
        if not self.inbox:
            threading.Event().wait(min(timeout or 0, 0.005))
        return self.inbox.popleft() if self.inbox else None


def upload_message(req: CollectRequest, device: str, params, n: int) -> bytes:
    return round_messages.UpdateMessage(
        FLEET, TASK, device, req.round, req.phase, n, req.global_hash, {"loss": 1.0}, params
    ).encode()


def test_two_workers_and_a_coordinator_hold_each_upload_once(tmp_path):
    bus = Bus()
    store = SqliteStore(tmp_path / "agg")
    # The garbage sender is not awaited: the round closes once the other eleven are counted.
    policy = CollectPolicy(deadline_s=20, expected=tuple(DEVICES[:-1]), max_extensions=0, startup_wait_s=5)
    coordinator = WorkerFleet(BusSession(bus), FLEET, policy, store, AdmissionPolicy(), workers=2)
    workers = [AggregatorWorker(BusSession(bus), FLEET, f"w{i}") for i in (1, 2)]
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for w in workers:
        bus.publish(wire.topic_worker(FLEET, w.id), wire.ONLINE, True)
    for d in DEVICES:
        bus.publish(topics.topic_status(FLEET, d), b'{"state": "online"}', True)
    coordinator.wait_for_devices(settle_s=0.1)

    strategy = make_strategy(SPEC)
    g = strategy.init_global()
    fold = strategy.fold("train")
    req = CollectRequest(SPEC, 1, "train", g, param_hash(g), {}, strategy.expected(g, "train"), fold=fold)
    rng = np.random.default_rng(2)
    sent = {
        d: (
            {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in g.items()},
            int(rng.integers(1, 500)),
        )
        for d in DEVICES
    }

    def devices() -> None:  # once the round is announced: one garbage, then every upload, d0's twice
        while not any(m for m in bus.retained if m.endswith("/down")):
            threading.Event().wait(0.01)
        bus.publish(topics.topic_up(FLEET, TASK, DEVICES[-1]), b"garbage", False)
        for d in ["d0", *DEVICES[:-1]]:  # d0 twice: one copy to each worker (round robin)
            params, n = sent[d]
            bus.publish(topics.topic_up(FLEET, TASK, d), upload_message(req, d, params, n), False)

    feeder = threading.Thread(target=devices, daemon=True)
    feeder.start()
    try:
        replies = coordinator.collect(req)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        feeder.join(5)
    updates = sorted(r.device for r in replies if isinstance(r, Update))
    rejected = {r.device: r.reason for r in replies if isinstance(r, Rejection)}
    assert updates == sorted(DEVICES[:-1])
    assert list(rejected) == [DEVICES[-1]] and rejected[DEVICES[-1]].startswith("malformed")
    # The re-send was judged by the other worker or refused by the first: a replay, counted once.
    assert coordinator.view.rejected_by_reason["d0"] == {"replay": 1}
    assert store.rejection_counts_by_reason(TASK) == {"d0": {"replay": 1}, DEVICES[-1]: {"malformed": 1}}
    assert sum(w.admitted for w in workers) >= len(DEVICES) - 1
    one = StreamingMean()
    for d in sorted(DEVICES[:-1]):
        one.add(*sent[d])
    assert fold.devices == set(DEVICES[:-1])
    assert param_hash(fold.mean.result()) == param_hash(one.result())
    store.close()


def test_a_batch_for_a_closed_round_is_counted_stale(tmp_path):
    bus = Bus()
    store = SqliteStore(tmp_path / "agg")
    coordinator = WorkerFleet(BusSession(bus), FLEET, CollectPolicy(), store, workers=1)
    batch = wire.Batch("w1", 1, TASK, 1, "train", "0" * 64, folded={"d1": (3, {})})
    coordinator.handle(Message(wire.topic_batch(FLEET, TASK, "w1"), batch.encode(), False), None)
    assert store.rejection_counts_by_reason(TASK) == {"d1": {"stale_round": 1}}
    assert codec.check_id("worker", "w1") == "w1"
    store.close()

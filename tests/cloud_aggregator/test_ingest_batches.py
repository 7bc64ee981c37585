"""The MQTT fleet ingests the uploads waiting in its queue as one batch: one SQLite transaction
for all of them, and only then the fold and the count (an upload counts once it is durable).
In process, over a fake session and a real SQLite store (no broker)."""

from __future__ import annotations

import numpy as np

from cloud_aggregator.aggregation.streaming import RoundFold, StreamingMean
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
from cloud_aggregator.store.sqlite import SqliteStore
from tests.cloud_aggregator.test_admission import DEVICES, FLEET, FakeSession, global_params, request, upload


class WatchedStore(SqliteStore):
    """A store that notes, at each write of uploads, how many uploads the round had folded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fold: RoundFold | None = None
        self.folded_at_write: list[int] = []

    def put_update(self, *args, **kwargs) -> bool:
        self.folded_at_write.append(self.fold.mean.count)
        return super().put_update(*args, **kwargs)

    def put_batch(self, updates, rejections) -> None:
        self.folded_at_write.append(self.fold.mean.count)
        super().put_batch(updates, rejections)


def test_waiting_uploads_commit_in_one_transaction_before_any_is_folded(tmp_path):
    store = WatchedStore(tmp_path / "agg.sqlite")
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    session = FakeSession()
    fleet = MqttFleet(session, FLEET, CollectPolicy(deadline_s=5.0, expected=tuple(DEVICES)), store)
    g = global_params()
    req = request(1, g)
    req = type(req)(**{**req.__dict__, "fold": RoundFold(lambda u: float(u.n_samples))})
    store.fold = req.fold
    rng = np.random.default_rng(0)
    sent = {
        d: {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in g.items()} for d in DEVICES
    }
    for d in DEVICES:
        session.queue.append(upload(req, d, sent[d]))

    out = fleet.collect(req)

    assert sorted(u.device for u in out if isinstance(u, Update)) == DEVICES
    # Every upload was written while nothing of the round was folded yet: durable, then counted.
    assert store.folded_at_write == [0]
    inserts = [s for s in statements if s.startswith("INSERT OR IGNORE INTO updates")]
    assert len(inserts) == len(DEVICES)
    assert [s for s in statements if s in ("BEGIN IMMEDIATE", "COMMIT")] == ["BEGIN IMMEDIATE", "COMMIT"]
    # The batch's fold holds the bits of folding each upload in arrival order.
    one_by_one = StreamingMean()
    for d in DEVICES:
        one_by_one.add(sent[d], 10.0)
    want, got = one_by_one.state()[0], req.fold.mean.state()[0]
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    assert len(store.stored_updates("t", 1, "train", req.global_hash)) == len(DEVICES)
    store.close()

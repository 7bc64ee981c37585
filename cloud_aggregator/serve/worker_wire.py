"""What aggregator workers and their coordinator say to each other (``cloud_aggregator.serve.workers``).

Cloud-side only: devices never see these topics, which live beside the fleet's under
``ioft/v1/<fleet>/agg/``:

``agg/worker/<worker>``  (retained, Last Will)
    ``{"state": "online" | "offline"}``: the coordinator counts live workers by these.
``agg/batch/<task>/<worker>``  worker → coordinator
    A :class:`Batch`: the partial sum of the uploads the worker admitted since its last
    batch (``StreamingMean.state()`` arrays), who they are, and the uploads it refused.
``agg/ctl``  coordinator → every worker
    ``{"flush": seq}``: send everything admitted now, tagged ``seq`` (a barrier), and
    ``{"ack": seq, "worker": w, "dupes": [...]}``: the coordinator merged batch ``seq``, or,
    when ``dupes`` is not empty, merged none of it (those devices are counted already):
    the worker folds the rest again and sends it as a new batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cloud_aggregator.aggregation.streaming import StreamingMean
from ioft_protocol import topics
from ioft_protocol.codec import WireError, check_id
from ioft_protocol.state import decode_arrays, encode_arrays

#: The shared-subscription group every worker of a fleet joins for its uplinks.
GROUP = "ioft-agg"
ONLINE, OFFLINE = b'{"state": "online"}', b'{"state": "offline"}'


def topic_uplinks_shared(fleet: str) -> str:
    """Every task's uplinks, shared among the fleet's workers (each upload reaches one of them)."""
    return f"$share/{GROUP}/{topics.topic_up_all(fleet)}"


def topic_worker(fleet: str, worker: str) -> str:
    return topics.topic_agg_worker(fleet, check_id("worker", worker))


def topic_worker_all(fleet: str) -> str:
    return topics.topic_agg_worker(fleet, topics.ANY)


def topic_batch(fleet: str, task: str, worker: str) -> str:
    return topics.topic_agg_batch(fleet, check_id("task", task), check_id("worker", worker))


def topic_batch_all(fleet: str) -> str:
    return topics.topic_agg_batch(fleet, topics.ANY, topics.ANY)


def topic_ctl(fleet: str) -> str:
    return topics.topic_agg_ctl(fleet)


@dataclass(frozen=True)
class AggTopic:
    """A parsed ``agg/`` topic: ``kind`` is ``worker``, ``batch`` or ``ctl``."""

    kind: str
    worker: str | None = None
    task: str | None = None


def parse(topic: str, fleet: str) -> AggTopic | None:
    """The ``agg/`` topic of ``fleet`` that ``topic`` is, or ``None`` (another kind of topic)."""
    prefix = topics.topic_agg(fleet) + "/"
    if not topic.startswith(prefix):
        return None
    rest = topic[len(prefix) :].split("/")
    try:
        if rest[0] == "worker" and len(rest) == 2:
            return AggTopic("worker", worker=check_id("worker", rest[1]))
        if rest[0] == "batch" and len(rest) == 3:
            return AggTopic("batch", worker=check_id("worker", rest[2]), task=check_id("task", rest[1]))
    except WireError:
        return None
    if rest == ["ctl"]:
        return AggTopic("ctl")
    return None


@dataclass
class Batch:
    """A worker's partial sum since its last batch, for one task's round.

    ``folded`` maps each device in the sum to ``(n_samples, metrics)``; ``refused`` lists
    ``(task, round, device, reason, detail)`` of the uploads the worker refused (any round);
    ``flush`` is the barrier this batch answers (``None``: sent on the worker's own clock).
    """

    worker: str
    seq: int
    task: str
    round: int
    phase: str
    global_hash: str
    mean: StreamingMean = field(default_factory=StreamingMean)
    folded: dict[str, tuple[int, dict[str, float]]] = field(default_factory=dict)
    refused: list[tuple[str, int | None, str, str, str]] = field(default_factory=list)
    flush: int | None = None

    def encode(self) -> bytes:
        arrays, mean_meta = self.mean.state()
        meta = {
            "worker": self.worker,
            "seq": self.seq,
            "task": self.task,
            "round": self.round,
            "phase": self.phase,
            "global_hash": self.global_hash,
            "mean": mean_meta,
            "folded": {d: [n, m] for d, (n, m) in self.folded.items()},
            "refused": [list(r) for r in self.refused],
            "flush": self.flush,
        }
        return encode_arrays(arrays, meta)

    @classmethod
    def decode(cls, payload: bytes) -> Batch:
        """Raises ``ValueError`` (a ``WireError`` among them) naming what is wrong."""
        arrays, meta = decode_arrays(payload)
        try:
            mean = StreamingMean.from_state(arrays, meta["mean"])
            return cls(
                worker=str(meta["worker"]),
                seq=int(meta["seq"]),
                task=str(meta["task"]),
                round=int(meta["round"]),
                phase=str(meta["phase"]),
                global_hash=str(meta["global_hash"]),
                mean=mean,
                folded={str(d): (int(n), dict(m)) for d, (n, m) in meta["folded"].items()},
                refused=[(str(t), r, str(d), str(why), str(x)) for t, r, d, why, x in meta["refused"]],
                flush=meta["flush"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"malformed worker batch: {exc!r}") from None


def encode_ctl(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True).encode()


def decode_ctl(payload: bytes) -> dict[str, Any]:
    """A control message; ``{}`` for anything that is not a JSON object."""
    try:
        body = json.loads(payload)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def is_online(payload: bytes) -> bool:
    try:
        return json.loads(payload).get("state") == "online"
    except (ValueError, AttributeError):
        return False

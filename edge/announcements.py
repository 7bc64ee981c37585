"""Round announcements decoded once per payload (a swarm's devices share one cache)."""

from __future__ import annotations

import logging

from ioft_protocol import round_messages
from trainer_lite.params import param_hash

log = logging.getLogger(__name__)


class Announcements:
    """Round announcements decoded once per payload: a swarm's devices share one of these.

    Every device of a swarm receives the same retained announcement (the same bytes); decoding
    it and checking its parameters' hash once per process instead of once per device is most of
    a swarm's downlink cost.  A daemon has its own (a re-sent announcement is not decoded again).
    The arrays of a cached announcement are read-only: devices share them, and none may change
    what it was sent.  A hit costs one comparison of the payload with the cached bytes.
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit  # topics kept (personal downlinks are one topic per device)
        self._by_topic: dict[str, tuple[bytes, round_messages.Announcement]] = {}
        self._hash_ok: round_messages.Announcement | None = None  # the last whose params_hash held

    def decode(self, topic: str, payload: bytes, max_bytes: int) -> round_messages.Announcement:
        """``Announcement.decode(payload)``, from the cache when ``topic`` last carried the same bytes."""
        hit = self._by_topic.get(topic)
        if hit is not None and len(payload) <= max_bytes and hit[0] == payload:
            return hit[1]
        ann = round_messages.Announcement.decode(payload, max_bytes=max_bytes)
        for arr in ann.params.values():
            arr.setflags(write=False)
        self._by_topic.pop(topic, None)
        if len(self._by_topic) >= self.limit:
            del self._by_topic[next(iter(self._by_topic))]
        self._by_topic[topic] = (bytes(payload), ann)
        return ann

    def params_match(self, ann: round_messages.Announcement, device: str) -> bool:
        """Whether ``ann``'s parameters hash to its ``params_hash`` (computed once per decoded object);
        if not, ``device`` drops the message, and says so."""
        if ann is self._hash_ok:
            return True
        if param_hash(ann.params) != ann.params_hash:
            log.warning(
                "%s dropped the announcement of task %s round %d: downlink parameters do not match their "
                "announced hash",
                device,
                ann.task,
                ann.round,
            )
            return False
        self._hash_ok = ann
        return True

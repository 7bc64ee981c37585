"""Retained messages are a cache, never the only way a side learns the other's state.

The protocol keeps two kinds of state retained: the round announcement a device must answer
(``task/<task>/down``, ``down/<device>``) and each device's status (``status/<device>``, its
Last Will saying offline).  How a broker hands retained messages out differs:

* mosquitto keeps one per topic for the whole broker and sends it to every subscription that
  matches, wildcards included;
* RabbitMQ 3.10's MQTT plugin keeps it **on the node it was published through** and sends it
  only to a subscription on **exactly** that topic -- never to ``status/+`` or ``task/+/down``,
  not even on a single node.  So an aggregator started after its devices sees none of them,
  and a device that connects after a round was announced never hears of the round; in a
  cluster the same holds for any subscriber on another node than the publisher's.

Live messages route everywhere on every broker (across cluster nodes too), so each side also
gets the state live when it needs it -- two exchanges, both correct on any broker:

1. **Roll call.**  The aggregator publishes an empty message on ``rollcall``
   (:func:`ioft_protocol.topics.topic_roll_call`, not retained) each time it connects; every
   device answers by publishing its status again.  Where retained statuses did arrive (mosquitto)
   the answer only repeats them.  ``fleet status`` and the console call the roll too
   (:func:`follow_statuses`).
2. **Re-announce to a new connection.**  A device's status carries ``connected_at``
   (:data:`CONNECTED_AT`), the time its current connection began.  When the aggregator sees a
   device online on a connection it has not seen (:func:`connection`), it sends that
   device the task's current announcement on the device's own downlink, not retained
   (:func:`restatement`).  A device that got the same announcement retained on this connection
   (mosquitto) drops the copy (:class:`Delivered`), so a round is neither trained nor
   uploaded twice; a re-announcement on the broadcast topic (an aggregator restart) is still
   answered by re-sending the upload: the restarted aggregator may not hold it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from ioft_protocol import topics
from ioft_protocol.mqtt import MqttSession

#: The status field (Unix time, float) saying when the device's current connection began.
CONNECTED_AT = "connected_at"
#: Announcements remembered per connection (a few tasks' rounds; older ones are forgotten).
_REMEMBERED = 256


def follow_statuses(session: MqttSession, fleet: str) -> None:
    """Subscribe ``session`` to every device's status and call the roll: the devices' answers
    bring the statuses live where the broker withholds the retained ones (``fleet status``, the
    console; the aggregator calls the roll on every connect)."""
    session.subscribe(topics.topic_status_all(fleet))
    session.publish(topics.topic_roll_call(fleet), b"", timeout=None)


def connection(status: Mapping[str, Any]) -> tuple[str, Any] | None:
    """The connection a device's status comes from, ``None`` if it says offline.

    Two statuses from one connection give equal values; the aggregator restates the current
    announcement to a device whose value it has not seen (``None`` before: it just came online).
    A status without ``connected_at`` (an older device) counts as new only when it comes online.
    """
    if status.get("state") != "online":
        return None
    return ("online", status.get(CONNECTED_AT))


def restatement(
    fleet: str, task: str, device: str, published: Sequence[tuple[str, bytes]]
) -> tuple[str, bytes] | None:
    """What to send ``device`` for ``task``: its own retained downlink if the aggregator published
    one, else the broadcast, on ``task/<task>/down/<device>``; ``None`` if nothing was announced.

    ``published`` is the task's latest announcement as published, ``(topic, payload)`` pairs with
    the broadcast first.
    """
    if not published:
        return None
    own = topics.topic_down_device(fleet, task, device)
    payload = next((p for t, p in published if t == own), published[0][1])
    return own, payload


class Delivered:
    """A device's memory of the announcements it handled on its current connection.

    ``connected()`` (from the session's on-connect hook) starts a new connection;
    ``duplicate(topic_kind, payload)`` records an announcement about to be handled and says
    whether it is a restated copy (on the device's own downlink) of one already handled on this
    connection.  Announcements on the broadcast topic are never duplicates: the aggregator
    re-announces there after a restart, and the device then re-sends its upload.
    """

    def __init__(self) -> None:
        self._link = 0
        self._seen: dict[bytes, int] = {}

    def connected(self) -> None:
        self._link += 1

    #: The last announcement hashed and its digest, shared by every instance: a swarm's thousands
    #: of devices each get the same bytes, hashed once instead of once per device.
    _last: tuple[bytes, bytes] | None = None

    def duplicate(self, kind: str, payload: bytes) -> bool:
        last = Delivered._last
        if last is not None and type(payload) is bytes and last[0] == payload:
            digest = last[1]
        else:
            digest = hashlib.sha256(payload).digest()
            if type(payload) is bytes:  # immutable: safe to keep
                Delivered._last = (payload, digest)
        link = self._link
        if kind == "down_device" and self._seen.get(digest) == link:
            return True
        self._seen.pop(digest, None)
        if len(self._seen) >= _REMEMBERED:
            del self._seen[next(iter(self._seen))]  # the oldest
        self._seen[digest] = link
        return False

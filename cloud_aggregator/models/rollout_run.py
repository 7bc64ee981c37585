"""Staged rollouts over MQTT: offer to the canaries, follow their statuses, promote or stop.

Every step is saved in the aggregator's store (``SqliteStore.put_rollout``) before
the next one, so a rollout interrupted anywhere (the command killed, the machine
restarted) is taken up again by ``rollout resume`` from what the store and the
devices' retained statuses say; publishing an offer twice is harmless (retained).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloud_aggregator.models.push import PushReport, offer_version, push_model
from cloud_aggregator.models.push_answers import INSTALLED
from cloud_aggregator.models.push_targets import ACK_TIMEOUT, retained, statuses
from cloud_aggregator.models.rollout import (
    CanaryResult,
    Rollout,
    RolloutError,
    State,
    Verdict,
    canary_result,
    decide,
    pick_canaries,
)
from cloud_aggregator.store.sqlite import SqliteStore
from export.keys import sign, signing_key_id
from export.package import Package
from ioft_protocol import codec, model_push, topics
from ioft_protocol.manifest import ModelManifest
from ioft_protocol.mqtt import MqttSession

log = logging.getLogger(__name__)


def save(store: SqliteStore, r: Rollout) -> None:
    store.put_rollout(r.model, r.version, str(r.state), r.to_json())


def latest(store: SqliteStore, model: str | None = None) -> list[Rollout]:
    """The latest rollout of each model (of ``model`` only when given), by start time."""
    by_model: dict[str, Rollout] = {}
    for text in store.rollouts(model):
        r = Rollout.from_json(text)
        if r.model not in by_model or r.started_at >= by_model[r.model].started_at:
            by_model[r.model] = r
    return sorted(by_model.values(), key=lambda r: r.started_at)


def start(
    session: MqttSession,
    store: SqliteStore,
    fleet: str,
    package: Package,
    *,
    canary: str,
    targets: tuple[str, ...],
    min_installed: float,
    margin: float,
    chunk_size: int,
    signing_key: Ed25519PrivateKey,
) -> tuple[Rollout, PushReport]:
    """Pick the canaries, publish the new version's chunks and an offer addressed to them, save.

    The replaced version's chunks stay on the broker until the rollout is promoted, so a
    stopped rollout leaves the fleet exactly as it was.  ``signing_key`` (the fleet key that
    signed the package) signs the withdrawal of this version now, kept for a stop.

    Raises
    ------
    RolloutError
        No version of the model on the fleet yet (nothing to roll back to), a newer one
        there, a rollout of it still in its canary phase, a canary as big as the fleet, or
        a signing key other than the one that signed the package.
    """
    m = package.manifest
    _check_can_start(store, m, signing_key)
    previous_offer, base = _offered(session, fleet, m)
    # Canaries: online devices running the replaced version (they have it to go back to).
    pool = [
        d
        for d, s in statuses(session, fleet, m.name).items()
        if s.get("state") == "online" and _active(s, m.name) == base and (not targets or d in targets)
    ]
    canaries = pick_canaries(canary, pool)
    report = push_model(
        session, fleet, package, chunk_size=chunk_size, devices=canaries, clear_previous=False
    )
    r = Rollout(
        m.name, m.version, base, canaries, targets, min_installed, margin, report.offer, previous_offer
    )
    r.withdrawal_signature = sign(model_push.withdrawal_text(m.name, (m.version,)), signing_key)
    save(store, r)
    return r, report


def _check_can_start(store: SqliteStore, m: ModelManifest, signing_key: Ed25519PrivateKey) -> None:
    """Refuse a signing key other than the package's, and a model whose last rollout is still in canary."""
    if signing_key_id(signing_key) != m.key_id:
        raise RolloutError(
            f"the signing key {signing_key_id(signing_key)} is not the fleet key {m.key_id} that signed "
            f"{m.name} v{m.version}; pass the fleet's private key"
        )
    for r in latest(store, m.name):
        if r.state == State.CANARY:
            raise RolloutError(
                f"the rollout of {m.name} v{r.version} is still in its canary phase: "
                f"`rollout resume {m.name}` or `rollout abort {m.name}` first"
            )


def _offered(session: MqttSession, fleet: str, m: ModelManifest) -> tuple[bytes, int]:
    """The offer of the version the fleet runs now (the rollout's way back) and that version, older
    than ``m``'s."""
    previous = retained(session, fleet, m.name, topics.topic_model_offer(fleet, m.name))
    previous_offer = next(iter(previous.values()), None)
    if previous_offer is None:
        raise RolloutError(
            f"no version of {m.name} is offered on fleet {fleet}, so canaries would have nothing to "
            "roll back to; push the first version without --canary"
        )
    base = offer_version(model_push.ModelOffer.decode(previous_offer))
    if base is None or base >= m.version:
        raise RolloutError(f"the fleet is offered {m.name} v{base}; a staged rollout needs a newer version")
    return previous_offer, base


def _active(status: dict, name: str) -> object:
    models = status.get("models")
    entry = models.get(name) if isinstance(models, dict) else None
    return entry.get("active") if isinstance(entry, dict) else None


def _decided_elsewhere(store: SqliteStore, r: Rollout) -> Rollout | None:
    """The stored record, when another command (``rollout abort``) decided this rollout meanwhile."""
    for text in store.rollouts(r.model):
        stored = Rollout.from_json(text)
        if stored.version == r.version and stored.state != State.CANARY:
            return stored
    return None


def follow(session: MqttSession, store: SqliteStore, fleet: str, r: Rollout, *, timeout: float) -> Rollout:
    """Follow the canaries' statuses until the rollout is decided (then act on it) or ``timeout``.

    Returns the rollout as saved: promoted, stopped, or still ``canary`` when the
    canaries had not said enough by the deadline (``rollout resume`` goes on later).
    """
    session.subscribe(topics.topic_status_all(fleet))
    seen: dict[str, dict | None] = dict.fromkeys(r.canaries)
    deadline = time.monotonic() + timeout
    try:
        while True:
            msg = session.get(min(0.1, max(0.0, deadline - time.monotonic())))
            if msg is not None:
                _note_status(seen, msg.topic, msg.payload)
                continue
            if (other := _decided_elsewhere(store, r)) is not None:
                return other  # before saving ours over it
            results = [canary_result(d, seen[d], r) for d in r.canaries]
            _record(store, r, results)
            final = time.monotonic() >= deadline
            verdict, reason = decide(
                results,
                min_installed=r.min_installed,
                margin=r.margin,
                base_version=r.base_version,
                final=final,
            )
            if verdict == Verdict.PROMOTE:
                return promote(session, store, fleet, r, reason)
            if verdict == Verdict.STOP:
                return stop(session, store, fleet, r, reason, timeout=timeout)
            if final:
                r.reason = reason
                save(store, r)
                return r
    finally:
        session.unsubscribe(topics.topic_status_all(fleet))


def _note_status(seen: dict[str, dict | None], topic: str, payload: bytes) -> None:
    try:
        device = topics.parse_topic(topic).device
        body = json.loads(payload) if payload else None
    except (codec.WireError, ValueError, RecursionError) as exc:
        log.warning("ignoring status on %s: %s", topic, exc)
        return
    if device in seen:
        seen[device] = body if isinstance(body, dict) else None


def _record(store: SqliteStore, r: Rollout, results: list[CanaryResult]) -> None:
    now = {res.device: {k: v for k, v in asdict(res).items() if k != "device"} for res in results}
    if now != r.results:
        r.results = now
        save(store, r)


def _clear_chunks(session: MqttSession, fleet: str, name: str, version: int, offer: bytes) -> None:
    n = len(model_push.ModelOffer.decode(offer).chunks)
    for i in range(n):
        session.publish(topics.topic_model_chunk(fleet, name, version, i), b"", retain=True, timeout=None)
    session.publish(
        topics.topic_model_chunk(fleet, name, version, n - 1), b"", retain=True, timeout=ACK_TIMEOUT
    )


def promote(session: MqttSession, store: SqliteStore, fleet: str, r: Rollout, reason: str) -> Rollout:
    """Offer the new version to the targets (the canaries already run it), then drop the old chunks."""
    offer = replace(model_push.ModelOffer.decode(r.canary_offer), devices=r.targets, pushed_at=time.time())
    session.publish(
        topics.topic_model_offer(fleet, r.model), offer.encode(), retain=True, timeout=ACK_TIMEOUT
    )
    r.state, r.reason, r.decided_at = State.PROMOTED, reason, time.time()
    save(store, r)
    _clear_chunks(session, fleet, r.model, r.base_version, r.previous_offer)
    log.info("rollout of %s v%d promoted: %s", r.model, r.version, reason)
    return r


def stop(
    session: MqttSession,
    store: SqliteStore,
    fleet: str,
    r: Rollout,
    reason: str,
    *,
    state: State = State.STOPPED,
    timeout: float = 30.0,
) -> Rollout:
    """Offer the replaced version again, withdrawing the new one (canaries roll back), and clear its chunks.

    Waits up to ``timeout`` for the canaries that installed it to report the rollback.
    """
    if r.state != State.CANARY:
        raise RolloutError(f"the rollout of {r.model} v{r.version} is {r.state}, not in its canary phase")
    # Who runs the new version now (the record may be older than the canaries' last answers).
    now = statuses(session, fleet, r.model)
    _record(store, r, [canary_result(d, now.get(d), r) for d in r.canaries])
    if not r.withdrawal_signature:
        log.warning(
            "the rollout of %s v%d has no signed withdrawal (started before withdrawals were signed): "
            "devices refuse it and the canaries keep v%d",
            r.model,
            r.version,
            r.version,
        )
    restore = replace(
        model_push.ModelOffer.decode(r.previous_offer),
        withdrawn=(r.version,),
        withdrawal_signature=r.withdrawal_signature,
    )
    session.publish(
        topics.topic_model_offer(fleet, r.model), restore.encode(), retain=True, timeout=ACK_TIMEOUT
    )
    r.state, r.reason, r.decided_at = state, reason, time.time()
    save(store, r)
    _clear_chunks(session, fleet, r.model, r.version, r.canary_offer)
    log.warning("rollout of %s v%d %s: %s", r.model, r.version, state, reason)
    _await_rollback(session, store, fleet, r, timeout)
    return r


def _await_rollback(session: MqttSession, store: SqliteStore, fleet: str, r: Rollout, timeout: float) -> None:
    """Mark each canary that ran the new version ``rolled_back`` once its status says so (scores kept)."""
    session.subscribe(topics.topic_status_all(fleet))
    seen: dict[str, dict | None] = dict.fromkeys(r.canaries)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            msg = session.get(0.1)
            if msg is not None:
                _note_status(seen, msg.topic, msg.payload)
                continue
            waiting = False
            for d in r.canaries:
                if seen[d] is None:
                    continue  # no status yet
                now = canary_result(d, seen[d], r)
                before = r.results.get(d, {})
                if now.state == INSTALLED:
                    waiting = True
                elif before.get("state") == INSTALLED and not before.get("rolled_back"):
                    before.update(rolled_back=True, detail=now.detail)  # ran it, runs it no longer
                    save(store, r)
                elif before.get("state") != INSTALLED and before.get("detail") != now.detail:
                    r.results[d] = {"state": now.state, "detail": now.detail}
                    save(store, r)
            if not waiting and all(seen[d] is not None for d in r.canaries):
                return
    finally:
        session.unsubscribe(topics.topic_status_all(fleet))

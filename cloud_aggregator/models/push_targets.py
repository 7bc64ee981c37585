"""Whom a push offers a model to, judged from the devices' retained statuses before anything is sent.

A model has one retained offer per fleet (``model/<name>/manifest``), and the offer's
``devices`` narrow who installs it.  So, before publishing:

- ids in ``--devices`` that no device of the fleet answers to (no retained status) are
  refused at once: an offer to them alone would wait out its timeout and replace the offer
  the other devices hold;
- a device whose data follow another feature schema than the model's (its status's
  ``data.schema``) would refuse it: a plain push leaves it out (``skipped``), a
  ``--devices`` naming it is refused;
- a narrowed offer must not take the replaced one from a device that still needs it (it
  was addressed, has neither installed nor refused it): that push is refused, naming them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from cloud_aggregator.models.push_answers import INSTALLED, REFUSED, answer_of
from ioft_protocol import codec, model_push, topics
from ioft_protocol.manifest import ModelManifest
from ioft_protocol.mqtt import MqttSession

ACK_TIMEOUT = 30.0


class TargetError(ValueError):
    """A push that would reach nobody, devices that are not there, or take an offer away: nothing is sent."""


@dataclass(frozen=True)
class Targets:
    """The offer's ``devices`` (empty: the whole fleet) and the devices left out, with why."""

    devices: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)


def _sync(session: MqttSession, fleet: str, name: str) -> None:
    """Return once the broker has handled our earlier SUBSCRIBEs (so their retained messages are queued).

    The broker handles one client's packets in order and sends a subscription's retained
    messages before handling the next packet; a QoS 1 publish's ack therefore comes after
    them.  The topic is one nobody follows (operators may write under ``model/#``).
    """
    probe = topics.topic_model_offer(fleet, name).rsplit("/", 1)[0] + "/rollout-sync"
    session.publish(probe, b"", timeout=ACK_TIMEOUT)


def retained(session: MqttSession, fleet: str, name: str, topic: str) -> dict[str, bytes]:
    """The retained messages on ``topic`` (a filter) right now, by topic."""
    session.subscribe(topic)
    _sync(session, fleet, name)
    found: dict[str, bytes] = {}
    while (msg := session.get(0.05)) is not None:
        if msg.retain and msg.payload:
            found[msg.topic] = bytes(msg.payload)
    session.unsubscribe(topic)
    return found


def statuses(session: MqttSession, fleet: str, name: str) -> dict[str, dict]:
    """Every device's retained status body, by device id."""
    out = {}
    for topic, payload in retained(session, fleet, name, topics.topic_status_all(fleet)).items():
        try:
            device, body = topics.parse_topic(topic).device, json.loads(payload)
        except (codec.WireError, ValueError, RecursionError):
            continue
        if device and isinstance(body, dict):
            out[device] = body
    return out


def replaced_offer(session: MqttSession, fleet: str, name: str) -> model_push.ModelOffer | None:
    """The model's retained offer a push would replace (``None``: none, or one that does not decode)."""
    found = retained(session, fleet, name, topics.topic_model_offer(fleet, name))
    try:
        return next((model_push.ModelOffer.decode(p) for p in found.values()), None)
    except codec.WireError:
        return None


def _schema_refusal(status: dict, manifest: ModelManifest) -> str | None:
    """Why this device would refuse the model for its feature schema (``None``: it would not, or its
    status does not say: a device from before statuses named their schema judges for itself)."""
    data = status.get("data")
    if not isinstance(data, dict) or "schema" not in data:
        return None
    ours = data["schema"]
    if ours == manifest.schema_hash:
        return None
    kind = status.get("kind")
    who = f"a {kind}" if isinstance(kind, str) else "its data"
    have = f"schema {ours[:12]}" if isinstance(ours, str) else "no feature schema"
    return f"{who} with {have}, the model wants {manifest.schema_hash[:12]}"


def _version_of(offer: model_push.ModelOffer) -> int | None:
    try:
        version = json.loads(offer.manifest).get("version")
    except (ValueError, AttributeError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def choose_targets(
    fleet: str,
    manifest: ModelManifest,
    requested: Sequence[str],
    known: dict[str, dict],
    replaced: model_push.ModelOffer | None,
) -> Targets:
    """The offer's devices for pushing ``manifest`` (``requested``: ``--devices``, empty: the fleet).

    ``known``: every device's retained status by id; ``replaced``: the offer on the broker now.

    Raises
    ------
    TargetError
        A requested id no device answers to, a requested device that would refuse the model,
        no device that can take it, or a narrowed offer that takes the replaced one away from
        devices still waiting for it.
    """
    if requested:
        unknown = sorted(set(requested) - set(known))
        if unknown:
            raise TargetError(
                f"no device {', '.join(unknown)} in fleet {fleet} (devices with a status: "
                f"{', '.join(sorted(known)) or 'none'}); check the ids, or start the device first"
            )
        refusing = {d: why for d in requested if (why := _schema_refusal(known[d], manifest))}
        if refusing:
            raise TargetError(
                f"{', '.join(sorted(refusing))} cannot take {manifest.name} v{manifest.version}: "
                + "; ".join(f"{d} is {why}" for d, why in sorted(refusing.items()))
            )
        targets = Targets(tuple(requested))
    else:
        skipped = {d: why for d, s in known.items() if (why := _schema_refusal(s, manifest))}
        if known and len(skipped) == len(known):
            raise TargetError(
                f"no device of fleet {fleet} can take {manifest.name} v{manifest.version}: "
                + "; ".join(f"{d} is {why}" for d, why in sorted(skipped.items()))
            )
        takers = tuple(sorted(set(known) - set(skipped)))
        # Everyone who can take it: the whole fleet, so a device enrolled later gets it too.
        targets = Targets(takers if skipped else (), dict(sorted(skipped.items())))
    _keep_replaced(fleet, manifest, targets, known, replaced)
    return targets


def _keep_replaced(
    fleet: str,
    manifest: ModelManifest,
    targets: Targets,
    known: dict[str, dict],
    replaced: model_push.ModelOffer | None,
) -> None:
    """Refuse a narrowed offer that leaves devices the replaced offer addressed without the version
    they are still to install (neither installed nor refused, by their statuses)."""
    if not targets.devices or replaced is None or replaced.name != manifest.name:
        return
    old = _version_of(replaced)
    if old is None or old >= manifest.version:
        return
    addressed = set(replaced.devices) if replaced.devices else set(known)
    waiting = sorted(
        d
        for d in addressed - set(targets.devices)
        if d in known and answer_of(d, known[d], manifest.name, old).state not in (INSTALLED, REFUSED)
    )
    if waiting:
        raise TargetError(
            f"an offer of {manifest.name} v{manifest.version} to {', '.join(targets.devices)} only would take "
            f"v{old}'s offer from {', '.join(waiting)}, which have not installed it yet: push to them too "
            "(--devices), or once they have"
        )

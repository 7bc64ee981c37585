"""``cloud-aggregator push``: publish a signed model package to a fleet over MQTT.

The retained offer (``model/<name>/manifest``: the signed manifest, the chunk
table and the addressed devices) goes out first, then the file as retained chunks
(``model/<name>/<version>/chunk/<i>``, QoS 1, each hashed and naming its push), so
devices fetch while the chunks stream; a device that joins later or reconnects
mid-transfer fetches what it lacks from the retained chunks.
Once the new offer is out, the chunks of the version it replaces are cleared
(empty retained messages), so the broker holds one version per model.

Nothing is published before the package is checked as a device would check it: the
signature with the fleet's public key (``--public-key``, the operator TOML's
``[model] public_key``, or the fleet folder's ``model/fleet.pub``) and the file's
size and sha256 against the manifest; a package that fails either never replaces
(and so never clears) the version the fleet has.  ``--wait`` then follows the
devices' retained statuses and prints each one's answer: installed, refused (with
its reason) or pending.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cloud_aggregator.models.push_answers import INSTALLED, PENDING, REFUSED, wait_for_answers
from cloud_aggregator.models.push_targets import TargetError, choose_targets, replaced_offer, statuses
from cloud_aggregator.operator import DefaultsHelpFormatter, add_session_args, operator_session
from export.package import Package, load_package
from ioft_protocol import codec, model_push, topics
from ioft_protocol.config import ConfigError, load_toml
from ioft_protocol.manifest import (
    ManifestError,
    ModelManifest,
    file_sha256,
    load_public_key,
    verify_manifest,
)
from ioft_protocol.mqtt import MqttSession

log = logging.getLogger(__name__)
#: Default chunk: 512 KiB, far under the brokers' default limits (mosquitto 2.0: none below
#: MQTT's 256 MB; RabbitMQ 3.10: max_message_size 128 MiB, 4.x: 16 MiB) and half a device's
#: default window (``model.window_bytes``, 1 MiB; a larger chunk is refused).  A device's
#: CPU per MB fetched has a cost per chunk: with 128 KiB chunks it was 3.44 ms/MB at 10 MB and
#: 5.40 at 1 MB, with 512 KiB 2.60 and 4.33 (benchmarks/results/model_push.md).  Managed brokers
#: that cap a message at 128-256 KB (AWS IoT Core, Azure IoT Hub) need ``--chunk-size 65536``.
DEFAULT_CHUNK_BYTES = 512 * 1024


@dataclass(frozen=True)
class PushReport:
    name: str
    version: int
    size: int
    chunks: int
    chunk_size: int
    seconds: float
    cleared_version: int | None
    offer: bytes = b""  # the retained offer as published (a staged rollout re-addresses it)


def chunk_table(data: bytes, chunk_size: int) -> list[str]:
    return [hashlib.sha256(data[i : i + chunk_size]).hexdigest() for i in range(0, len(data), chunk_size)]


def push_messages(
    fleet: str,
    package: Package,
    *,
    chunk_size: int = DEFAULT_CHUNK_BYTES,
    devices: Sequence[str] = (),
    data: bytes | None = None,
) -> list[tuple[str, bytes]]:
    """The retained ``(topic, payload)`` messages of a push, in publishing order: the offer, then the chunks.

    The offer goes first so devices start fetching while the chunks stream out (a
    device subscribed to a chunk topic gets the chunk live, or retained if it comes
    later); every chunk names its push, so a stale retained chunk from an earlier
    push of the same version is told apart and skipped.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    devices = tuple(codec.check_id("device", d) for d in devices)  # before anything is published
    manifest = package.manifest
    name, version = manifest.name, manifest.version
    data = package.onnx_path.read_bytes() if data is None else data
    if hashlib.sha256(data).hexdigest() != manifest.sha256 or len(data) != manifest.size:
        raise ValueError(f"{package.onnx_path} does not match its manifest (sha256/size); re-export it")
    table = chunk_table(data, chunk_size)
    transfer = model_push.transfer_id(chunk_size, table)
    chunks = [
        (
            topics.topic_model_chunk(fleet, name, version, i),
            model_push.ModelChunk(
                name, version, i, data[i * chunk_size : (i + 1) * chunk_size], transfer
            ).encode(digest=table[i]),
        )
        for i in range(len(table))
    ]
    offer = model_push.ModelOffer(
        name=name,
        manifest=package.manifest_json,
        signature=package.signature,
        chunk_size=chunk_size,
        chunks=tuple(table),
        devices=tuple(devices),
        pushed_at=time.time(),
    )
    return [(topics.topic_model_offer(fleet, name), offer.encode()), *chunks]


def _replaced_offer(session: MqttSession, topic: str, ours: bytes) -> model_push.ModelOffer | None:
    """The offer our push replaced, from the retained copy the broker sent when we subscribed.

    The broker sends a topic's retained message right after the SUBACK and before it
    handles our later publishes, and paho hands messages over in arrival order; so once
    our own offer is acked, the replaced one (if any) is already in the inbound queue.
    """
    found = None
    while (msg := session.get(0.05)) is not None:
        if msg.topic != topic or not msg.retain or not msg.payload or msg.payload == ours:
            continue
        try:
            found = model_push.ModelOffer.decode(msg.payload)
        except codec.WireError as exc:
            log.warning("the replaced offer on %s is malformed (%s); its chunks stay", topic, exc)
    session.unsubscribe(topic)
    return found


def push_model(
    session: MqttSession,
    fleet: str,
    package: Package,
    *,
    chunk_size: int = DEFAULT_CHUNK_BYTES,
    devices: Sequence[str] = (),
    clear_previous: bool = True,
    ack_timeout: float = 60.0,
) -> PushReport:
    """Publish ``package``'s chunks and offer (all retained, QoS 1) and wait for the broker's acks."""
    manifest = package.manifest
    name, version = manifest.name, manifest.version
    started = time.perf_counter()
    messages = push_messages(fleet, package, chunk_size=chunk_size, devices=devices)
    offer_topic, offer_payload = messages[0]
    if clear_previous:
        session.subscribe(offer_topic)  # the broker answers with the offer this push replaces
    for topic, payload in messages[:-1]:
        # Pipelined: paho keeps up to its in-flight window of QoS 1 publishes outstanding.
        session.publish(topic, payload, retain=True, timeout=None)
    # The broker handles one client's packets in order: the last chunk's ack means all are stored.
    session.publish(*messages[-1], retain=True, timeout=ack_timeout)
    seconds = time.perf_counter() - started
    previous = _replaced_offer(session, offer_topic, offer_payload) if clear_previous else None
    n_chunks, size = len(messages) - 1, manifest.size
    cleared = None
    old = offer_version(previous) if previous is not None else None
    if previous is not None and old is not None:
        # Another version's chunks, or this version's beyond the new count (a re-push with other chunks).
        stale = range(len(previous.chunks)) if old != version else range(n_chunks, len(previous.chunks))
        for i in stale:
            session.publish(topics.topic_model_chunk(fleet, name, old, i), b"", retain=True, timeout=None)
        if stale:
            session.publish(
                topics.topic_model_chunk(fleet, name, old, stale[-1]), b"", retain=True, timeout=ack_timeout
            )
            cleared = old
    log.info(
        "pushed %s v%d: %d bytes in %d chunks of %d to fleet %s%s in %.3f s",
        name,
        version,
        size,
        n_chunks,
        chunk_size,
        fleet,
        f" (devices {list(devices)})" if devices else "",
        seconds,
    )
    return PushReport(name, version, size, n_chunks, chunk_size, seconds, cleared, offer_payload)


class PushCheckError(ValueError):
    """A package that would not install anywhere: nothing is published for it."""


def verify_package(package: Package, public_key: Ed25519PublicKey) -> ModelManifest:
    """Check ``package`` as a device will: the signature with the fleet key, then the file.

    Parameters
    ----------
    package
        The package to push.
    public_key
        The fleet's Ed25519 public key (the one every device names in ``[model] public_key``).

    Returns
    -------
    ModelManifest
        The verified manifest.

    Raises
    ------
    PushCheckError
        If the signature does not verify (another key, or the manifest edited after
        signing) or the ONNX file's size or sha256 differs from the manifest's.
    """
    try:
        manifest = verify_manifest(package.manifest_json, package.signature, public_key)
    except ManifestError as exc:
        raise PushCheckError(f"{package.manifest_path}: {exc}; export and sign it again") from None
    size = package.onnx_path.stat().st_size
    if size != manifest.size or file_sha256(package.onnx_path) != manifest.sha256:
        raise PushCheckError(
            f"{package.onnx_path} ({size} bytes) is not the file its manifest signed "
            f"({manifest.size} bytes, sha256 {manifest.sha256[:12]}...); export it again"
        )
    return manifest


def offer_version(offer: model_push.ModelOffer) -> int | None:
    try:
        version = json.loads(offer.manifest).get("version")
    except (ValueError, AttributeError):
        return None
    return version if isinstance(version, int) else None


# -- command line ---------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "push",
        help="publish a signed model package to the fleet over MQTT",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("model", type=Path, help="the package: <name>-v<version>.manifest.json (or .onnx)")
    add_session_args(p)
    p.add_argument(
        "--public-key",
        type=Path,
        help="the fleet's Ed25519 public key the package must verify with (none given: the --config "
        "TOML's [model] public_key, else model/fleet.pub in the fleet folder holding --config)",
    )
    p.add_argument(
        "--devices",
        action="append",
        default=None,
        metavar="ID,ID",
        help="install only on these devices, comma-separated (printer1,printer2; none given: all)",
    )
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_BYTES, help="bytes per chunk")
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait for the devices' answers and print installed / refused (reason) / pending per device",
    )
    p.add_argument(
        "--wait-timeout",
        type=float,
        default=120.0,
        help="seconds --wait waits before calling a device pending",
    )
    p.set_defaults(func=main)
    return p


def fleet_public_key(args: argparse.Namespace) -> Ed25519PublicKey:
    """The key a push must verify with: ``--public-key``, the ``--config`` TOML's
    ``[model] public_key`` (relative to the TOML's folder), or ``model/fleet.pub`` in the
    fleet folder that holds ``--config`` (``fleet init``'s layout).

    Raises
    ------
    ManifestError
        If no key is named or found, or the file is not an Ed25519 public key.
    ConfigError
        If ``--config`` is not readable TOML.
    """
    path = args.public_key
    if path is None and args.config:
        named = load_toml(args.config).get("model", {})
        if isinstance(named, dict) and isinstance(named.get("public_key"), str):
            path = Path(args.config).parent / named["public_key"]
        elif (Path(args.config).resolve().parent.parent / "model" / "fleet.pub").is_file():
            path = Path(args.config).resolve().parent.parent / "model" / "fleet.pub"
    if path is None:
        raise ManifestError(
            "no fleet public key to check the package with; pass --public-key FLEET/model/fleet.pub "
            "(or --config FLEET/operator/operator.toml)"
        )
    return load_public_key(path)


def parse_devices(values: Sequence[str] | None) -> tuple[str, ...]:
    """``--devices`` as ids: comma- and/or space-separated, each a valid device id (``codec.check_id``).

    ``None`` (no ``--devices``) means the whole fleet; a ``--devices`` naming nobody is an
    error rather than a silent push to everyone.

    Raises
    ------
    ValueError
        On an invalid or duplicated id, or an empty list.
    """
    if values is None:
        return ()
    ids = [d for v in values for d in v.replace(",", " ").split()]
    if not ids:
        raise ValueError("--devices names no device (give ids like printer1,printer2)")
    for d in ids:
        codec.check_id("device", d)
    dupes = sorted({d for d in ids if ids.count(d) > 1})
    if dupes:
        raise ValueError(f"--devices names {', '.join(dupes)} more than once")
    return tuple(ids)


#: A staged push (``rollout_cli.canary_push``): given the checked package and the open session.
CanaryPush = Callable[[argparse.Namespace, MqttSession, str, Package, tuple[str, ...]], int]


def main(args: argparse.Namespace, *, canary: CanaryPush | None = None) -> int:
    """Check the package, push it, and with ``--wait`` report each device's answer.

    With ``canary``, the checked package goes to it instead (a staged rollout).

    Returns
    -------
    int
        0 on success (with ``--wait``: every device installed it), 1 when a device
        refused it or had not answered by ``--wait-timeout``, 2 for an operator mistake.
    """
    try:
        devices = parse_devices(args.devices)  # checked before any session: nothing published or cleared
        package = load_package(args.model)
        manifest = verify_package(package, fleet_public_key(args))
        if args.chunk_size < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {args.chunk_size}")
        session, fleet = operator_session(args, "push")
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        print(f"cannot push: {exc}", file=sys.stderr)
        return 2
    try:
        return _push(args, session, fleet, package, manifest, devices, canary)
    except TargetError as exc:
        print(f"cannot push: {exc}", file=sys.stderr)
        return 2
    finally:
        session.stop()


def _push(
    args: argparse.Namespace,
    session: MqttSession,
    fleet: str,
    package: Package,
    manifest: ModelManifest,
    devices: tuple[str, ...],
    canary: CanaryPush | None,
) -> int:
    """``main`` once the package is checked and the session open: whom to offer it to, then the push."""
    known = statuses(session, fleet, manifest.name)
    if canary is not None:  # a staged rollout picks its canaries itself, among these
        if devices:
            choose_targets(fleet, manifest, devices, known, None)
        return canary(args, session, fleet, package, devices)
    targets = choose_targets(fleet, manifest, devices, known, replaced_offer(session, fleet, manifest.name))
    for d, why in targets.skipped.items():
        print(f"not offered to {d}: {why}")
    devices = targets.devices
    report = push_model(session, fleet, package, chunk_size=args.chunk_size, devices=devices)
    print(
        f"pushed {report.name} v{report.version} to fleet {fleet}: {report.size} bytes in "
        f"{report.chunks} chunks ({report.seconds:.3f} s)"
        + (f"; for devices {', '.join(devices)}" if devices else "")
        + (f"; cleared v{report.cleared_version}'s chunks" if report.cleared_version else ""),
        flush=True,
    )
    if not args.wait:
        return 0
    answers = wait_for_answers(
        session, fleet, manifest.name, manifest.version, devices, timeout=args.wait_timeout
    )
    if not answers:
        print("no device has a status yet: nobody to wait for")
        return 1
    for a in answers:
        print(f"  {a.device}: {a.state}" + (f" ({a.detail})" if a.detail else ""))
    counts = {state: sum(a.state == state for a in answers) for state in (INSTALLED, REFUSED, PENDING)}
    print(", ".join(f"{n} {state}" for state, n in counts.items()))
    return 0 if counts[INSTALLED] == len(answers) else 1

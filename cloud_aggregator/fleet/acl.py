"""The fleet broker's ACL: which topics each login (device, aggregator, worker, operator, Home
Assistant, plant bridge) may read and write, each under its own ``user`` line."""

from __future__ import annotations

from collections.abc import Sequence

from cloud_aggregator.fleet.layout import DISCOVERY_PREFIX, HOME_ASSISTANT, worker_identity
from cloud_aggregator.operator import AGGREGATOR, OPERATOR_SLOTS, operator_slot
from ioft_protocol import codec, topics
from ioft_protocol.topics import ANY


def worker_acl_text(fleet: str, worker: str, what: str) -> str:
    """What aggregator worker ``worker`` (user ``worker.<id>``) may do on the broker it reads uploads from.

    Read: the devices' uploads (it subscribes through the shared group
    ``$share/ioft-agg/.../task/+/up/+``; mosquitto 2.0.11 checks a shared subscription, and each
    message delivered through it, against the plain topic), their statuses (selections are judged
    from them), the round announcements and the coordinator's ``agg/ctl``.  Write: its own batches
    (``agg/batch/<task>/<id>``) and its own state (birth, Last Will, retained: ``agg/worker/<id>``)
    only.  ``what``: the comment line above the stanza.
    """
    w = codec.check_id("worker", worker)
    return f"""
# {what}
user {worker_identity(w)}
topic read {topics.topic_up_all(fleet)}
topic read {topics.topic_status_all(fleet)}
topic read {topics.topic_down_all(fleet)}
topic read {topics.topic_agg_ctl(fleet)}
topic write {topics.topic_agg_batch(fleet, ANY, w)}
topic readwrite {topics.topic_agg_worker(fleet, w)}
"""


def device_acl_text(fleet: str, devices: Sequence[str]) -> str:
    """The ACL's device part: each device's own topics and the broadcasts it reads, under its ``user`` line.

    No ``pattern`` lines: mosquitto applies a pattern to every login, so ``write .../status/%u``
    let the aggregator, the operator's certificate or Home Assistant write a status in their own
    name that the aggregator took for a device's.  Here a login gets exactly the lines of its name.
    """
    return "".join(
        f"""
user {codec.check_id("device", d)}
topic write {topics.topic_up(fleet, ANY, d)}
# A task with scaling = "fleet": its feature sums, once (ioft_protocol.feature_stats).
topic write {topics.topic_stats(fleet, ANY, d)}
topic write {topics.topic_status(fleet, d)}
# Its answers to its own new rows and its alerts (edge.serving): only the device writes them.
topic write {topics.topic_answer_all(fleet, d)}
topic write {topics.topic_alert_all(fleet, d)}
# Its Home Assistant discovery configs: serve republishes them, rebuilt, under homeassistant/.
topic write {topics.topic_discovery_all(fleet, d)}
topic read {topics.topic_down_device(fleet, ANY, d)}
# Secure aggregation: its own SecAgg answers out, only what is addressed to it in.
topic write {topics.topic_secagg_up(fleet, ANY, d)}
topic read {topics.topic_secagg_down(fleet, ANY, d)}
# The task broadcasts, the model pushes and the aggregator's roll call.
topic read {topics.topic_down_all(fleet)}
topic read {topics.topic_model_offer_all(fleet)}
topic read {topics.topic_model_chunk_all(fleet)}
topic read {topics.topic_roll_call(fleet)}
topic read {topics.topic_scaling_all(fleet)}
"""
        for d in sorted(devices)
    )


def revoked_acl_text(fleet: str, revoked: Sequence[str]) -> str:
    """A revoked device may write its own status only: ``fleet end-sessions`` takes its live session
    over with a one-off certificate and leaves that status as ``revoked`` (the aggregator then stops
    waiting for it); its own certificate is refused at the handshake once the broker has the CRL."""
    return "".join(
        f"\n# {d}: revoked (`fleet end-sessions` leaves its status as revoked).\n"
        f"user {d}\ntopic write {topics.topic_status(fleet, d)}\n"
        for d in sorted(revoked)
    )


def operator_acl_text(fleet: str) -> str:
    """The operator's rights, once per login of its listener (``operator.1`` .. ``operator.N``).

    That listener makes the login its client id, so an operator session can never take a
    device's (or serve's) client id; each session claims a login of its own
    (:func:`cloud_aggregator.operator.claim_operator_login`).  The bare ``operator`` name, which
    its certificate alone carries on the devices' listener, gets no line here: nothing.
    """
    t = topics
    return "".join(
        f"""
user {operator_slot(k)}
topic readwrite {t.topic_models(fleet)}
topic read {t.topic_status_all(fleet)}
topic read {t.topic_answer_all(fleet)}
topic read {t.topic_alert_all(fleet)}
topic write {t.topic_roll_call(fleet)}
{BROKER_BYTES_ACL}"""
        for k in range(1, OPERATOR_SLOTS + 1)
    )


def home_assistant_acl_text(fleet: str, prefix: str = DISCOVERY_PREFIX) -> str:
    """Home Assistant (``ha``): reads the discovery configs and the topics its entities show
    (statuses for availability, answers, alerts); writes nothing, reads no uplink."""
    t = topics
    return f"""
# Home Assistant (`ha`, fleet init's ha/): the discovery configs the aggregator publishes and the
# state its entities show.  Nothing else: no uplinks, no downlinks, no writes.
user {HOME_ASSISTANT}
topic read {prefix}/#
topic read {t.topic_status_all(fleet)}
topic read {t.topic_answer_all(fleet)}
topic read {t.topic_alert_all(fleet)}
"""


def bridge_acl_text(fleet: str, bridge: str, devices: Sequence[str], worker: str = "") -> str:
    """What a plant's bridge may carry on the cloud broker: its devices' uplinks out, their downlinks in.

    With a plant worker (``worker``, its id: ``fleet add-plant --partial-aggregator``) the devices'
    uploads stay at the plant: the bridge writes that worker's batches and state instead, and reads
    the coordinator's control messages (``cloud_aggregator.serve.worker_wire``).
    """
    lines = [f"user {bridge}", f"topic read {topics.topic_down_all(fleet)}",
             f"topic read {topics.topic_model_offer_all(fleet)}",
             f"topic read {topics.topic_model_chunk_all(fleet)}", f"topic read {topics.topic_roll_call(fleet)}",
             f"topic read {topics.topic_scaling_all(fleet)}"]  # fmt: skip
    if worker:
        w = codec.check_id("worker", worker)
        lines += [
            f"topic write {topics.topic_agg_batch(fleet, ANY, w)}",
            f"topic write {topics.topic_agg_worker(fleet, w)}",
            f"topic read {topics.topic_agg_ctl(fleet)}",
        ]
    for d in sorted(devices):
        codec.check_id("device", d)
        lines += [
            *([] if worker else [f"topic write {topics.topic_up(fleet, ANY, d)}"]),
            f"topic write {topics.topic_status(fleet, d)}",
            f"topic write {topics.topic_stats(fleet, ANY, d)}",
            f"topic write {topics.topic_answer_all(fleet, d)}",
            f"topic write {topics.topic_alert_all(fleet, d)}",
            f"topic write {topics.topic_secagg_up(fleet, ANY, d)}",
            f"topic read {topics.topic_down_device(fleet, ANY, d)}",
            f"topic read {topics.topic_secagg_down(fleet, ANY, d)}",
        ]
    return "\n".join(lines) + "\n"


#: The broker's byte counters the console's ``/metrics`` shows (``console_feed.SYS_BYTES``): read
#: only, and only these two (the rest of ``$SYS`` names clients).
BROKER_BYTES_ACL = """# The console (under either login): the broker's byte counters for /metrics.
topic read $SYS/broker/bytes/received
topic read $SYS/broker/bytes/sent
"""


def aggregator_acl_text(fleet: str) -> str:
    """The aggregator's rights: every uplink and status in, the downlinks out, its lock, its roll call,
    the plant workers' batches, Home Assistant's discovery; and the broker's byte counters."""
    t = topics
    return f"""
# The aggregator: reads every uplink and status, publishes (and reads back) the downlinks.
user {AGGREGATOR}
topic read {t.topic_up_all(fleet)}
topic read {t.topic_stats_all(fleet)}
topic readwrite {t.topic_scaling_all(fleet)}
topic read {t.topic_status_all(fleet)}
topic read {t.topic_answer_all(fleet)}
topic read {t.topic_alert_all(fleet)}
topic readwrite {t.topic_down_all(fleet)}
topic readwrite {t.topic_down_device(fleet, ANY, ANY)}
topic read {t.topic_secagg_up(fleet, ANY, ANY)}
topic write {t.topic_secagg_down(fleet, ANY, ANY)}
# Its lock: one aggregator per fleet (cloud_aggregator.serve.singleton).
topic readwrite {t.topic_aggregator_lock(fleet)}
# Its roll call: every device re-publishes its status (ioft_protocol.restate).
topic write {t.topic_roll_call(fleet)}
# As the coordinator of plant workers (`fleet add-plant --partial-aggregator`): their batches and
# states in, its flushes and acknowledgements out (cloud_aggregator.serve.worker_wire).
topic read {t.topic_agg_batch(fleet, ANY, ANY)}
topic read {t.topic_agg_worker(fleet, ANY)}
topic write {t.topic_agg_ctl(fleet)}
# Home Assistant: the devices' discovery configs in, rebuilt under its prefix out
# (cloud_aggregator.serve.home_assistant); no device writes there.
topic read {t.topic_discovery_all(fleet)}
topic readwrite {DISCOVERY_PREFIX}/#
{BROKER_BYTES_ACL}"""


def acl_text(
    fleet: str,
    devices: Sequence[str] = (),
    bridges: dict[str, Sequence[str]] | None = None,
    plant_workers: dict[str, str] | None = None,
    workers: Sequence[str] = (),
    revoked: Sequence[str] = (),
) -> str:
    """The mosquitto ACL for one fleet and its ``devices``; ``bridges``: plant bridge identity -> its devices.

    Every device writes only its own uplinks and status and reads its own per-device
    downlinks and the task broadcasts and model pushes: ``topic`` lines under its own ``user``
    line (its certificate CN or username), so a device missing here (revoked) reads and writes
    nothing, and no other login gets a device's rights (:func:`device_acl_text`).
    ``aggregator``, ``operator`` and ``ha`` are reserved and can never be device ids.  A plant's bridge
    (``fleet add-plant``) writes and reads only its own devices' topics (:func:`bridge_acl_text`);
    ``plant_workers``: bridge identity -> the id of its plant's partial aggregator, if it has one;
    ``workers``: the ids of the aggregator's own workers (``[collect] workers``), each logging in as
    ``worker.<id>`` (:func:`worker_acl_text`).
    """
    partial = plant_workers or {}
    plants = "".join(
        f"\n# Plant bridge {b} (`fleet add-plant`): its devices' topics, nothing else.\n"
        + bridge_acl_text(fleet, b, ds, partial.get(b, ""))
        for b, ds in sorted((bridges or {}).items())
    )
    cloud_workers = "".join(
        worker_acl_text(fleet, w, f"Aggregator worker {w} (`cloud-aggregator worker --id {w}`, serve's [collect] workers).")
        for w in sorted(workers)
    )  # fmt: skip
    return f"""# ioft fleet {fleet}: generated by `cloud-aggregator fleet init` (add-device and
# revoke-device rewrite it). A `user` is a client's certificate CN (or password-file user):
# each login gets the lines under its own name and nothing else.
{device_acl_text(fleet, devices)}{revoked_acl_text(fleet, revoked)}
{aggregator_acl_text(fleet)}{cloud_workers}
# Operator commands (`push`, `fleet status`, `console`): model pushes and reading the fleet's
# status, under each login of the operator's listener.
{operator_acl_text(fleet)}{home_assistant_acl_text(fleet)}{plants}"""

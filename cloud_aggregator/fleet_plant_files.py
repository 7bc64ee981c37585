"""What a plant's broker reads: its mosquitto config with the bridge to the cloud, its ACL, its record.

A plant (``cloud-aggregator fleet add-plant``) runs its own mosquitto beside its machines;
its devices connect to it, and one bridge connection carries their traffic to the fleet's
(cloud) broker under the same topics.  Written here, and rewritten when a device of the
plant is revoked (:func:`refresh_plant`, called by ``fleet revoke-device``).

What crosses the bridge, per direction (the cloud ACL grants the bridge's identity exactly
these, for its own devices: :func:`cloud_aggregator.fleet_layout.bridge_acl_text`)::

    out (plant -> cloud)   task/+/up/+, status/+, task/+/secagg/up/+
    in  (cloud -> plant)   task/+/down (announcements, retained), task/+/down/+,
                           task/+/secagg/down/+, model/+/manifest, model/+/+/chunk/+

The aggregator's lock (``<fleet>/aggregator``) stays on the cloud.

With a plant worker (``fleet add-plant --partial-aggregator``: ``cloud-aggregator worker --plant``
at the plant, logging in as ``worker.<plant>``, its worker id the plant id), the devices'
uploads stay at the plant: ``task/+/up/+`` does not cross; the worker's batches
(``agg/batch/+/<plant>``) and its state (``agg/worker/<plant>``) go out, the coordinator's
``agg/ctl`` comes in (:data:`PARTIAL_OUT_TOPICS`, :data:`PARTIAL_IN_TOPICS`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from cloud_aggregator import worker_wire as wire
from cloud_aggregator.fleet_layout import (
    MAX_PACKET_BYTES,
    FleetLayout,
    PlantRecord,
    _toml_str,
    device_acl_text,
    replace_file,
)
from ioft_protocol import codec, topics

#: The bridge protocols mosquitto 2 speaks; the wire is MQTT 3.1.1, so mqttv311 is the default.
BRIDGE_PROTOCOLS = ("mqttv311", "mqttv50")
#: Messages the plant broker queues per client (the bridge's queue is the one that matters: a round's
#: burst of the plant's uploads and statuses, and every uplink while the WAN is down, waits in it; past
#: it mosquitto drops QoS 1 messages silently).  As the cloud broker's (``mosquitto_conf_text``).
PLANT_QUEUE = 100_000

#: Topic patterns under ``ioft/v1/<fleet>/`` by direction, as bridge ``topic`` lines take them.
OUT_TOPICS = ("task/+/up/+", "status/+", "task/+/secagg/up/+")
IN_TOPICS = (
    "task/+/down", "task/+/down/+", "task/+/secagg/down/+", "model/+/manifest", "model/+/+/chunk/+", "rollcall",
)  # fmt: skip
#: With a plant-level partial aggregator (``cloud-aggregator worker --plant``, issue 14): the
#: devices' uploads stay at the plant; its one batch per round, its Last Will and the
#: coordinator's flush requests and acknowledgements cross instead (``cloud_aggregator.worker_wire``).
PARTIAL_OUT_TOPICS = ("status/+", "task/+/secagg/up/+", "agg/batch/+/+", "agg/worker/+")
PARTIAL_IN_TOPICS = (*IN_TOPICS, "agg/ctl")


def bridge_topic_lines(fleet: str, *, partial: bool = False) -> list[str]:
    """The bridge's ``topic`` lines: every device upload crosses, or (``partial``) only the plant's batches."""
    out, into = (PARTIAL_OUT_TOPICS, PARTIAL_IN_TOPICS) if partial else (OUT_TOPICS, IN_TOPICS)
    p = f"{topics.PROTOCOL}/{fleet}"
    return [f"topic {p}/{t} out 1" for t in out] + [f"topic {p}/{t} in 1" for t in into]


def plant_dir(layout: FleetLayout, plant: str) -> Path:
    return layout.root / "plants" / plant


def bridge_identity(plant: str) -> str:
    """The bridge's certificate CN (its username on the cloud broker).

    The dot keeps it out of the device id space (``[a-z0-9][a-z0-9_-]*``): no device can be
    enrolled under a bridge's name, nor a bridge take a device's.
    """
    return f"bridge.{plant}"


def worker_identity(plant: str) -> str:
    """The plant worker's certificate CN (its username and client id on the plant broker); the dot
    keeps it out of the device id space, as :func:`bridge_identity`'s."""
    return f"worker.{plant}"


def worker_acl_text(fleet: str, plant: PlantRecord) -> str:
    """What the plant worker may do on the plant broker: read its devices' uploads (through the shared
    subscription), statuses and announcements and the coordinator's control messages; write its own
    batches and its state (birth and Last Will) only."""
    p = f"{topics.PROTOCOL}/{fleet}"
    w = codec.check_id("worker", plant.worker)
    return f"""
# The plant's partial aggregator (`cloud-aggregator worker --plant --id {w}`): one batch per round to the cloud.
user {worker_identity(plant.plant)}
topic read {p}/task/+/up/+
topic read $share/{wire.GROUP}/{p}/task/+/up/+
topic read {p}/status/+
topic read {p}/task/+/down
topic read {p}/agg/ctl
topic write {p}/agg/batch/+/{w}
topic readwrite {p}/agg/worker/{w}
"""


def plant_acl_text(fleet: str, plant: PlantRecord) -> str:
    """The plant broker's ACL: its devices' own topics, and its partial aggregator's if it has one
    (no cloud aggregator or operator logs in here)."""
    return (
        f"# ioft fleet {fleet}, plant {plant.plant}: generated by `cloud-aggregator fleet add-plant`\n"
        "# (revoke-device rewrites it). %u is a client's certificate CN.\n"
        + device_acl_text(fleet, plant.devices)
        + (worker_acl_text(fleet, plant) if plant.worker else "")
    )


def worker_toml_text(layout: FleetLayout, plant: PlantRecord) -> str:
    """``worker.toml``: the plant worker's connection (the plant broker, its certificate)."""
    d, cn = plant_dir(layout, plant.plant), worker_identity(plant.plant)
    return f"""# ioft fleet {layout.fleet}, plant {plant.plant}: the plant's partial aggregator (`cloud-aggregator fleet add-plant`).
# Run (paths are absolute: edit them after moving this folder):
#   cloud-aggregator worker --plant --id {plant.worker} --config {d / "worker.toml"}
# It admits uploads as serve does: copy serve's [admission] table here if aggregator.toml sets one.
fleet = {_toml_str(layout.fleet)}
broker = {_toml_str(plant.broker)}
client_id = {_toml_str(cn)}  # the broker uses the certificate CN as client id anyway

[tls]
ca_file = {_toml_str(d / "ca.crt")}
cert_file = {_toml_str(d / f"{cn}.crt")}
key_file = {_toml_str(d / f"{cn}.key")}
"""


def plant_toml_text(plant: PlantRecord) -> str:
    devices = ", ".join(_toml_str(d) for d in plant.devices)
    return (
        f"# ioft plant {plant.plant} (`cloud-aggregator fleet add-plant`); fleet revoke-device keeps it current.\n"
        f"plant = {_toml_str(plant.plant)}\nbridge = {_toml_str(plant.bridge)}\n"
        f"broker = {_toml_str(plant.broker)}\ndevices = [{devices}]\n"
        + (f"worker = {_toml_str(plant.worker)}  # its partial aggregator's id\n" if plant.worker else "")
    )


def plant_conf_text(
    layout: FleetLayout,
    plant: PlantRecord,
    *,
    port: int,
    bind: str | None,
    cloud: str,
    protocol: str = "mqttv311",
    restart_timeout: tuple[int, int] = (2, 30),
) -> str:
    """The plant's mosquitto.conf: a TLS listener for its devices and a TLS bridge to ``cloud`` (host:port).

    ``cleansession false``: the cloud keeps the bridge's subscriptions and queues the plant's
    downlinks while the link is down; ``local_cleansession false``: the plant keeps the bridge's
    local subscriptions and queues the devices' uplinks meanwhile (up to ``PLANT_QUEUE``).
    """
    d = plant_dir(layout, plant.plant)
    listener = f"listener {port}" + (f" {bind}" if bind else "")
    lines = "\n".join(bridge_topic_lines(layout.fleet, partial=bool(plant.worker)))
    base, cap = restart_timeout
    return f"""# ioft fleet {layout.fleet}, plant {plant.plant}: generated by `cloud-aggregator fleet add-plant`.
# Runs on the plant's gateway: copy this folder there (paths are absolute: edit them after moving it).
# Devices of the plant connect here; the bridge below carries their topics to the cloud broker unchanged.
per_listener_settings false
allow_anonymous false
acl_file {d / "acl"}
persistence true
persistence_location {d / "data"}/
set_tcp_nodelay true
max_packet_size {MAX_PACKET_BYTES}
# A round's burst, and every uplink of the plant while the cloud is unreachable, queue for the bridge.
max_queued_messages {PLANT_QUEUE}

{listener}
protocol mqtt
cafile {d / "ca.crt"}
certfile {d / "server.crt"}
keyfile {d / "server.key"}
tls_version tlsv1.2
require_certificate true
use_identity_as_username true
crlfile {d / "crl.pem"}
use_username_as_clientid true

# The bridge: one TLS connection to the cloud broker as {plant.bridge} (the cloud ACL grants it its devices'
# topics only).  mqttv311 works against any MQTT 3.1.1 broker (try_private false for a non-mosquitto one).
connection cloud
address {cloud}
remote_clientid {plant.bridge}
bridge_protocol_version {protocol}
cleansession false
local_cleansession false
restart_timeout {base} {cap}
keepalive_interval 30
# The cloud refuses a client that writes $SYS: the link's state is published on the plant only.
notifications true
notifications_local_only true
bridge_cafile {d / "ca.crt"}
bridge_certfile {d / f"{plant.bridge}.crt"}
bridge_keyfile {d / f"{plant.bridge}.key"}
bridge_tls_version tlsv1.2
bridge_insecure false
{lines}
"""


def plant_dropin(layout: FleetLayout, plant: str, mosquitto: str = "/usr/sbin/mosquitto") -> str:
    """A drop-in for Debian's ``mosquitto.service`` on the plant's gateway: the plant's config."""
    return f"""\
# ioft fleet {layout.fleet}, plant {plant}: Debian's mosquitto.service runs the plant broker's config.
# Install as /etc/systemd/system/mosquitto.service.d/ioft.conf, then systemctl daemon-reload;
# systemctl restart mosquitto.  (Started as root, mosquitto drops to its own user.)
[Service]
ExecStart=
ExecStart={mosquitto} -c {plant_dir(layout, plant) / "mosquitto.conf"}
"""


def refresh_plant(layout: FleetLayout, plant: PlantRecord) -> None:
    """Rewrite a plant's ACL, record and CRL copy from the fleet's (after add- or revoke-device)."""
    d = plant_dir(layout, plant.plant)
    replace_file(d / "acl", plant_acl_text(layout.fleet, plant))
    replace_file(d / "plant.toml", plant_toml_text(plant))
    if layout.crl.exists():
        tmp = d / ".crl.pem.new"
        shutil.copyfile(layout.crl, tmp)
        tmp.replace(d / "crl.pem")

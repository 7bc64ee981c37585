"""``cloud-aggregator fleet end-sessions``: end a revoked device's live session on the broker.

mosquitto 2.0.11 reads the CRL again on a reload (SIGHUP) but checks it only at the TLS
handshake: a device connected with a certificate revoked since keeps its session, and the
ACL's ``pattern`` lines (``%u``) still let it write its uploads and status.  (A password
fleet has no such gap: the reload checks every session's password again and drops those
whose line went.)  A full restart of the broker drops every device, and the dynamic-security
plugin's ``kickClient`` needs that plugin in place of the fleet's ACL and password files.

What works on the fleet's own broker, without either: ``use_username_as_clientid`` makes a
login's certificate CN its client id, and a second login with a client id already connected
takes that session over ("already connected, closing old connection"), dropping the first
and, with a clean session, its queue.  So this command, holding the CA key, issues a one-off
certificate for the revoked device (valid 10 minutes, never written outside a private temp
folder, put in the CRL afterwards), logs in with it once, leaves the device's retained
status as ``revoked`` (its own topic: the aggregator then neither selects nor waits for it,
``cloud_aggregator.serve.mqtt_fleet``) and disconnects.  The revoked device's reconnection is
refused at the handshake.

That holds only once the broker has loaded the new CRL; before, the device would just log in
again.  So ``revoke-device`` also revokes a canary certificate (``ca/crl-canary.crt``), and
this command first checks that the broker refuses it, waiting up to ``wait_s`` for the reload.
"""

from __future__ import annotations

import json
import ssl
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import paho.mqtt.client as paho

from cloud_aggregator.fleet.ca import FleetCA, cert_serial
from cloud_aggregator.fleet.layout import FleetInitError, FleetLayout, open_fleet, replace_file
from cloud_aggregator.operator import revoked_serials
from ioft_protocol import topics
from ioft_protocol.mqtt_options import BrokerAddress

#: The canary's CN: a space keeps it apart from every device id.
CANARY = "ioft crl canary"
#: How long the one-off certificate that takes a revoked device's session over is valid.
ONE_OFF_MINUTES = 10
CONNECT_TIMEOUT_S = 10.0


def canary_files(layout: FleetLayout) -> tuple[Path, Path]:
    return layout.root / "ca" / "crl-canary.crt", layout.root / "ca" / "crl-canary.key"


def new_canary(layout: FleetLayout, ca: FleetCA) -> int:
    """A fresh canary certificate (kept beside the CA key); its serial, for the CRL."""
    cert, key = ca.issue(CANARY, days=3650)
    cert_path, key_path = canary_files(layout)
    replace_file(key_path, key, private=True)
    replace_file(cert_path, cert)
    return cert_serial(cert)


def _login(
    address: BrokerAddress, ca: Path, cert: Path, key: Path, client: str, status: bytes | None
) -> bool:
    """Log in once with ``cert``; publish ``status`` (retained) to ``client``'s own status topic
    when accepted; ``True`` when the broker accepted the login."""
    c = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
    c.tls_set(ca_certs=str(ca), certfile=str(cert), keyfile=str(key), cert_reqs=ssl.CERT_REQUIRED,
              tls_version=ssl.PROTOCOL_TLS_CLIENT)  # fmt: skip
    answered, accepted = threading.Event(), threading.Event()

    def on_connect(client, userdata, flags, reason_code, properties) -> None:
        if not reason_code.is_failure:
            accepted.set()
        answered.set()

    c.on_connect = on_connect
    c.on_disconnect = lambda *_: answered.set()
    try:
        c.connect(address.host, address.port, keepalive=30)
    except (OSError, ssl.SSLError):
        return False  # the handshake refused the certificate (or the broker is not there)
    c.loop_start()
    try:
        answered.wait(CONNECT_TIMEOUT_S)
        if accepted.is_set() and status is not None:
            c.publish(client, status, qos=1, retain=True).wait_for_publish(CONNECT_TIMEOUT_S)
        return accepted.is_set()
    except (RuntimeError, ValueError):  # paho: the connection went while publishing
        return accepted.is_set()
    finally:
        c.disconnect()
        c.loop_stop()


def end_sessions(
    root: str | Path,
    devices: Sequence[str],
    *,
    crl_days: int,
    broker: str | None = None,
    wait_s: float = 10.0,
) -> list[str]:
    """Take over the live session of each revoked device in ``devices``; the devices done (none in a
    password fleet: its reload did it).  ``crl_days``: the rewritten CRL's validity.

    Raises
    ------
    FleetInitError
        A device still enrolled (revoke it first), a broker that still accepts the canary
        after ``wait_s`` (not reloaded), or one that cannot be reached.
    """
    layout = open_fleet(root)
    enrolled = [d for d in devices if d in layout.devices]
    if not devices or enrolled:
        raise FleetInitError(
            f"{', '.join(enrolled) or 'no device'}: only a revoked device's session is ended "
            "(fleet revoke-device first)"
        )
    if layout.auth != "certs":
        return []  # the broker's reload checked every password again and dropped the revoked
    address = BrokerAddress.parse(broker or layout.broker_url)
    ca = FleetCA.load(layout.ca_cert, layout.root / "ca" / "ca.key")
    cert_path, key_path = canary_files(layout)
    if not cert_path.exists():
        raise FleetInitError(f"{cert_path} is missing: run fleet revoke-device again (it writes the canary)")
    deadline = time.monotonic() + wait_s
    while _login(address, layout.ca_cert, cert_path, key_path, "", None):
        if time.monotonic() >= deadline:
            raise FleetInitError(
                f"the broker at {address.url()} still accepts a revoked certificate: it has not loaded the "
                "new CRL; reload it (systemctl reload mosquitto, or kill -HUP <mosquitto's pid>), then run "
                "this again"
            )
        time.sleep(0.2)
    serials = set()
    with tempfile.TemporaryDirectory(prefix="ioft-end-session-") as folder:  # 0700
        for device in devices:
            cert, key = ca.issue(device, days=1, minutes=ONE_OFF_MINUTES)
            c, k = Path(folder) / "one-off.crt", Path(folder) / "one-off.key"
            c.write_bytes(cert)
            k.touch(mode=0o600)
            k.write_bytes(key)
            status = {"device": device, "state": "revoked", "time": time.time()}
            topic = topics.topic_status(layout.fleet, device)
            if not _login(address, layout.ca_cert, c, k, topic, json.dumps(status).encode()):
                raise FleetInitError(f"could not log in at {address.url()} to end {device}'s session")
            serials.add(cert_serial(cert))
    # In the CRL too (from the next reload): expiring in minutes, it needs no reload of its own.
    before = revoked_serials(layout.crl.read_bytes()) if layout.crl.exists() else set()
    replace_file(layout.crl, ca.crl(before | serials, days=crl_days))
    return list(devices)

"""One login's files in a fleet folder: its certificate and key, its client TOML (device, aggregator,
operator) or an aggregator worker's login TOML."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from cloud_aggregator.fleet.ca import FleetCA, cert_expiry, cert_serial
from cloud_aggregator.fleet.files import write_file
from cloud_aggregator.fleet.layout import (
    AGGREGATOR_STATE_DIR,
    OPERATOR,
    RESERVED,
    FleetLayout,
    worker_identity,
)
from cloud_aggregator.operator import AGGREGATOR, OPERATOR_LOGIN


def toml_str(s: str | Path) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def client_toml(layout: FleetLayout, name: str) -> str:
    """The connection part of a device's (or the aggregator's, or the operator's) TOML.

    A device's names its files relative to its own folder (``edge.config`` resolves them
    against the TOML's folder), so ``devices/<id>/`` works wherever it is copied; the
    aggregator's and operator's name theirs by absolute path in the fleet folder.
    """
    device = name not in RESERVED
    lines = [f"# ioft fleet {layout.fleet}: {name}'s broker connection (`cloud-aggregator fleet init`)."]
    if device:
        lines += [
            "# Copy this folder to the device; paths are relative to it.",
            f"# Run: edge-trainer --device {name} --config <this folder>/device.toml",
            f"device = {toml_str(name)}",
        ]
    broker = layout.operator_url if name == OPERATOR else layout.plant_brokers.get(name, layout.broker_url)
    lines += [f"fleet = {toml_str(layout.fleet)}", f"broker = {toml_str(broker)}"]
    if device:
        lines.append(f"state_dir = {toml_str(f'/var/lib/ioft/{name}')}")
    if name == AGGREGATOR:
        lines += [
            f"client_id = {toml_str(AGGREGATOR)}  # the broker uses the username as client id anyway",
            f"state_dir = {toml_str(AGGREGATOR_STATE_DIR)}  # the store; top-level keys go above [tls]",
        ]
    if name == OPERATOR:
        # console, push --canary and rollout read the aggregator's store: where serve keeps it.
        lines.append(f"state_dir = {toml_str(AGGREGATOR_STATE_DIR)}  # the aggregator's (serve's state_dir)")
    if name in layout.passwords:
        # The operator: one of operator.1 .. operator.N, whichever is free (operator.claim_operator_login).
        user = OPERATOR_LOGIN if name == OPERATOR else name
        lines += [f"username = {toml_str(user)}", f"password = {toml_str(layout.passwords[name])}"]
    ca, cert, key = layout.ca_cert, layout.cert(name), layout.key(name)
    if device:
        ca, cert, key = Path(layout.device_ca(name).name), Path(cert.name), Path(key.name)
    lines += ["", "[tls]", f"ca_file = {toml_str(ca)}"]
    if layout.auth == "certs" or (name == OPERATOR and layout.operator_port):
        lines += [f"cert_file = {toml_str(cert)}", f"key_file = {toml_str(key)}"]
    if name == AGGREGATOR:
        lines += ["", "# Add [collect] and [[task]] tables here; see README."]
    if name == OPERATOR:
        lines += [
            "",
            f"# Models are signed with {layout.signing_key} (export --key); push checks them with:",
            "[model]",
            f"public_key = {toml_str(layout.model_public_key)}",
        ]
    if device:
        lines += ["", "[model]", f"public_key = {toml_str(layout.device_model_key(name).name)}"]
    return "\n".join(lines) + "\n"


def worker_login_toml(layout: FleetLayout, worker: str) -> str:
    """``aggregator/workers/<id>.toml``: worker ``<id>``'s login, which ``cloud-aggregator worker --config
    aggregator.toml --id <id>`` (and so each worker ``serve`` starts) puts in place of aggregator.toml's;
    everything else (broker, [admission], ...) stays aggregator.toml's.  Absolute paths, like aggregator.toml's."""
    lines = [
        f"# ioft fleet {layout.fleet}: aggregator worker {worker}'s login (`cloud-aggregator fleet add-worker`).",
        f"# `cloud-aggregator worker --config {layout.toml(AGGREGATOR)} --id {worker}` (each worker serve starts",
        "# too) logs in with this instead of aggregator.toml's own login; the rest comes from aggregator.toml.",
    ]
    cn = worker_identity(worker)
    if layout.auth == "passwords":
        lines += [f"username = {toml_str(cn)}", f"password = {toml_str(layout.passwords[cn])}"]
    else:
        lines += ["", "[tls]", f"cert_file = {toml_str(layout.workers_dir / f'{cn}.crt')}",
                  f"key_file = {toml_str(layout.workers_dir / f'{cn}.key')}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def issue(
    ca: FleetCA, layout: FleetLayout, name: str, folder: Path, *, days: int, server_hosts: Sequence[str] = ()
) -> None:
    """Issue ``name``'s certificate and key into ``folder`` and record it in ``ca/issued.tsv``."""
    cert, key = ca.issue(name, server_hosts=server_hosts, days=days)
    stem = "server" if server_hosts else name
    write_file(folder / f"{stem}.crt", cert)
    write_file(folder / f"{stem}.key", key, private=True)
    with layout.issued.open("a") as fh:
        fh.write(f"{cert_serial(cert):x}\t{name}\t{cert_expiry(cert).isoformat()}\n")


def write_identity(
    ca: FleetCA | None,
    layout: FleetLayout,
    name: str,
    *,
    days: int,
    staged: FleetLayout | None = None,
    folder: Path | None = None,
) -> None:
    """Everything ``name`` needs: its certificate and key (``ca``: certificate auth), its TOML (naming
    ``layout``'s paths), and for a device the CA certificate and model key.

    Files go under ``staged`` (a fleet folder being built; default ``layout``), into ``folder``
    (default: ``name``'s identity folder there).
    """
    staged = layout if staged is None else staged
    folder = staged.identity_dir(name) if folder is None else folder
    if ca is not None:
        issue(ca, staged, name, folder, days=days)
    # A password in the TOML makes it a secret too.
    write_file(folder / layout.toml(name).name, client_toml(layout, name), private=name in layout.passwords)
    if name not in RESERVED:
        shutil.copyfile(staged.ca_cert, folder / layout.device_ca(name).name)
        shutil.copyfile(staged.model_public_key, folder / layout.device_model_key(name).name)


def write_worker_identity(
    ca: FleetCA | None,
    layout: FleetLayout,
    worker: str,
    *,
    days: int,
    staged: FleetLayout | None = None,
    folder: Path | None = None,
) -> None:
    """Aggregator worker ``worker``'s certificate and key (``ca``: certificate auth; CN ``worker.<id>``,
    recorded in ``staged``'s ``ca/issued.tsv``) and its login TOML (naming ``layout``'s paths), into
    ``folder`` (default: ``staged``'s ``aggregator/workers/``; ``staged`` defaults to ``layout``).
    A password makes the TOML a secret."""
    staged = layout if staged is None else staged
    folder = staged.workers_dir if folder is None else folder
    if ca is not None:
        issue(ca, staged, worker_identity(worker), folder, days=days)
    login = worker_login_toml(layout, worker)
    write_file(folder / layout.worker_login(worker).name, login, private=layout.auth == "passwords")

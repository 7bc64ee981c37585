"""``fleet init``'s ``ha/``: Home Assistant's login to the fleet's broker and its MQTT settings.

The ``ha`` login reads the discovery configs ``serve`` republishes and the state topics its entities
show, and writes nothing (its ACL lines: :func:`cloud_aggregator.fleet.acl.home_assistant_acl_text`;
why: ``docs/security.md``).
"""

from __future__ import annotations

import shutil

from cloud_aggregator.fleet.ca import FleetCA
from cloud_aggregator.fleet.files import write_file
from cloud_aggregator.fleet.identity import issue
from cloud_aggregator.fleet.layout import DISCOVERY_PREFIX, HOME_ASSISTANT, FleetLayout


def home_assistant_text(layout: FleetLayout) -> str:
    """``ha/home-assistant.txt``: Home Assistant's MQTT integration settings for the ``ha`` login."""
    folder = layout.identity_dir(HOME_ASSISTANT)
    host, port = layout.broker_url.removeprefix("mqtts://").rsplit(":", 1)
    lines = [
        f"Home Assistant's login to ioft fleet {layout.fleet} (`cloud-aggregator fleet init`).",
        "It reads the discovery configs (which the aggregator publishes from the devices' own, with",
        "their names checked) and the statuses, answers and alerts its entities show; it writes nothing.",
        "",
        "Settings > Devices & services > MQTT > Configure > Re-configure MQTT (advanced options on):",
        f"  Broker:                 {host.strip('[]')}  (fleet init --bind: where Home Assistant reaches it)",
        f"  Port:                   {port}",
    ]
    if HOME_ASSISTANT in layout.passwords:
        lines += [f"  Username:               {HOME_ASSISTANT}",
                  f"  Password:               {layout.passwords[HOME_ASSISTANT]}"]  # fmt: skip
    lines += [
        "  Use a client ID:        off (the broker names the session after the login anyway)",
        "  Broker certificate validation: Custom; upload CA file: " + str(folder / "ca.crt"),
    ]
    if layout.auth == "certs":
        lines += [
            "  Use a client certificate: on",
            f"    Upload client certificate file: {folder / f'{HOME_ASSISTANT}.crt'}",
            f"    Upload private key file:        {folder / f'{HOME_ASSISTANT}.key'}",
        ]
    lines += [
        "  MQTT protocol:          3.1.1; transport: TCP",
        "Then Configure MQTT options: discovery on, discovery prefix " + DISCOVERY_PREFIX + ",",
        "birth and last-will messages off (this login may not publish).",
    ]
    return "\n".join(lines) + "\n"


def write_home_assistant(ca: FleetCA | None, layout: FleetLayout, *, days: int, staged: FleetLayout) -> None:
    """``ha/``: Home Assistant's certificate and key (``ca``: certificate auth), the CA and its settings."""
    folder = staged.identity_dir(HOME_ASSISTANT)
    if ca is not None:
        issue(ca, staged, HOME_ASSISTANT, folder, days=days)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(staged.ca_cert, folder / "ca.crt")
    private = HOME_ASSISTANT in layout.passwords
    write_file(folder / "home-assistant.txt", home_assistant_text(layout), private=private)

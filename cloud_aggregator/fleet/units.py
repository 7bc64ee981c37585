"""systemd units for a fleet, written by ``fleet init`` and ``fleet add-device``.

What goes where::

    devices/<id>/systemd/ioft-edge-trainer@.service    the device daemon, one instance per device id
    devices/<id>/systemd/ioft-edge-recorder@.service   its recorder (the only one in the i2c group)
    devices/<id>/install.sh                             run as root on the device: the user, the
                                                        folder as /etc/ioft/<id>/, the units
    systemd/ioft-aggregator.service                     ``cloud-aggregator serve --service``
    systemd/mosquitto.service.d/ioft.conf               Debian's mosquitto.service, on the fleet's conf
    plants/<plant>/systemd/ioft-plant-worker.service    a plant's partial aggregator (``fleet add-plant
                                                        --partial-aggregator``)

The device units are templates whose instance is the device id (``systemctl enable
ioft-edge-trainer@printer1``): the copied device folder is ``/etc/ioft/<id>/`` and the
state folder ``/var/lib/ioft/<id>`` (``StateDirectory=``, owned by the service's user),
as in the ``device.toml`` fleet init writes.  ioft's commands come from the Python
environment ``venv`` (``/opt/ioft``: ``python3 -m venv /opt/ioft``, then pip installs the
wheel there).

Every unit: a dedicated system user (``ioft`` on a device, ``ioft-aggregator`` for
serve), ``Type=notify`` with a watchdog (the daemons send READY once connected and a ping
from each turn of their main loop: :mod:`ioft_protocol.service`), ``Restart=on-failure``
but not after exit 2 (a config mistake, which a restart cannot mend), and a sandbox:
the whole file system read-only but the state folder, no home folders, a private
``/tmp``, no new privileges, no capabilities, only the address families MQTT and the
notify socket need, systemd's ``@system-service`` system calls.  Logs go to the journal
(``journalctl -u ioft-edge-trainer@printer1``), which rotates them; an SD card's
``/var/log`` would not.
"""

from __future__ import annotations

import grp
import os
import re
from pathlib import Path

from cloud_aggregator.fleet.files import write_file
from cloud_aggregator.fleet.layout import AGGREGATOR, FleetLayout

#: The system user the device units run as (``useradd --system ioft``).
DEVICE_USER = "ioft"
#: The system user ``serve``'s unit runs as.
AGGREGATOR_USER = "ioft-aggregator"
#: Where a device folder is copied on its Pi (``/etc/ioft/<id>/device.toml``).
DEVICE_ROOT = "/etc/ioft"
#: The Python environment the units run ioft's commands from.
DEFAULT_VENV = Path("/opt/ioft")
TRAINER_UNIT = "ioft-edge-trainer@.service"
RECORDER_UNIT = "ioft-edge-recorder@.service"
AGGREGATOR_UNIT = "ioft-aggregator.service"
MOSQUITTO_DROPIN = Path("mosquitto.service.d") / "ioft.conf"
#: A plant's partial aggregator (``fleet add-plant --partial-aggregator``), in ``plants/<plant>/systemd/``.
PLANT_WORKER_UNIT = "ioft-plant-worker.service"
#: Watchdog: longer than the longest step of a main loop (a device's training round, one
#: aggregation), short enough that a hung loop is restarted within minutes.
WATCHDOG_S = {"trainer": 300, "recorder": 60, "aggregator": 300, "plant_worker": 60}

# The sandbox every unit shares (systemd.exec(5)).
_HARDENING = """\
NoNewPrivileges=yes
ProtectSystem=strict
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RemoveIPC=yes
CapabilityBoundingSet=
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM
UMask=0027"""


def _restart(watchdog_s: int) -> str:
    return f"""\
Restart=on-failure
RestartSec=5
# Exit 2 is a config mistake (one line in the journal says which): restarting cannot mend it.
RestartPreventExitStatus=2
WatchdogSec={watchdog_s}"""


def _device_unit(program: str, fleet: str, venv: Path, about: str, needs: str, service: str) -> str:
    """One of a device's two units (``ioft-<program>@.service``; the instance is the device id).

    ``about`` and ``needs`` head the file (what it runs; what the device needs first);
    ``service`` holds the [Service] lines the program alone needs (devices, sandbox).
    """
    return f"""\
# ioft fleet {fleet}: {about}, written by `cloud-aggregator fleet init`.
# {needs}
#   systemctl enable --now ioft-{program}@<id>
[Unit]
Description=ioft {program} %i (fleet {fleet})
After=network-online.target time-sync.target
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={venv}/bin/{program} --device %i --config {DEVICE_ROOT}/%i/device.toml
User={DEVICE_USER}
Group={DEVICE_USER}
StateDirectory=ioft/%i
StateDirectoryMode=0750
ReadWritePaths=/var/lib/ioft/%i
{_restart(WATCHDOG_S[program.removeprefix("edge-")])}
{service}
{_HARDENING}

[Install]
WantedBy=multi-user.target
"""


def trainer_unit(fleet: str, venv: Path = DEFAULT_VENV) -> str:
    """``ioft-edge-trainer@.service``: ``edge-trainer`` for the device named by the instance."""
    return _device_unit(
        "edge-trainer",
        fleet,
        venv,
        "the device daemon",
        f"The instance is the device id: with this folder copied to {DEVICE_ROOT}/<id>/,",
        """\
# It waits for the broker as long as it takes: each turn of its loop extends the start timeout.
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes""",
    )


def recorder_unit(fleet: str, venv: Path = DEFAULT_VENV) -> str:
    """``ioft-edge-recorder@.service``: ``edge-recorder``, with the I2C bus (group ``i2c``) and nothing else."""
    return _device_unit(
        "edge-recorder",
        fleet,
        venv,
        "the recorder beside the device daemon",
        f"It needs a [sensors] table in {DEVICE_ROOT}/<id>/device.toml (see README), then",
        """\
# The accelerometer: /dev/i2c-N belongs to group i2c (Raspberry Pi OS, raspi-config enables it).
SupplementaryGroups=i2c
DevicePolicy=closed
DeviceAllow=char-i2c rw
# Klipper's socket (accel = "klipper") is /tmp/klippy_uds or ~/printer_data/comms/klippy.sock:
# the recorder sees the real /tmp and reads (never writes) home folders; the socket must let
# the ioft user connect.
ProtectHome=read-only
PrivateTmp=no""",
    )


def _cloud_service_end(watchdog_s: int, protect_home: str) -> str:
    """The end of a cloud-side unit (``serve``, a plant worker): it waits for the broker, restarts,
    and runs in the shared sandbox; ``protect_home``: systemd's ``ProtectHome=``."""
    return f"""\
# It waits for the broker as long as it takes; the watchdog counts from READY (connected).
TimeoutStartSec=infinity
{_restart(watchdog_s)}
ProtectHome={protect_home}
PrivateTmp=yes
PrivateDevices=yes
{_HARDENING}

[Install]
WantedBy=multi-user.target
"""


def aggregator_unit(
    layout: FleetLayout, venv: Path = DEFAULT_VENV, state_dir: str = "/var/lib/ioft-aggregator"
) -> str:
    """``ioft-aggregator.service``: ``cloud-aggregator serve --service`` on the fleet's aggregator.toml."""
    home = any(layout.root.is_relative_to(p) for p in (Path("/home"), Path("/root"), Path("/run/user")))
    return f"""\
# ioft fleet {layout.fleet}: the aggregator, written by `cloud-aggregator fleet init`.
#   systemctl enable --now ioft-aggregator; systemctl reload ioft-aggregator re-reads the tasks
[Unit]
Description=ioft aggregator (fleet {layout.fleet})
After=network-online.target mosquitto.service
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={venv}/bin/cloud-aggregator serve --service --config {layout.toml(AGGREGATOR)}
ExecReload=/bin/kill -HUP $MAINPID
User={AGGREGATOR_USER}
Group={AGGREGATOR_USER}
StateDirectory={Path(state_dir).relative_to("/var/lib")}
StateDirectoryMode=0750
ReadWritePaths={state_dir}
{_cloud_service_end(WATCHDOG_S["aggregator"], "read-only" if home else "yes")}"""


def plant_worker_unit(fleet: str, plant: str, worker: str, toml: Path, venv: Path = DEFAULT_VENV) -> str:
    """``ioft-plant-worker.service``: ``cloud-aggregator worker --plant`` on the plant's gateway."""
    return f"""\
# ioft fleet {fleet}, plant {plant}: the plant's partial aggregator, written by `cloud-aggregator fleet add-plant`.
# Its key must be readable by {AGGREGATOR_USER} (useradd --system {AGGREGATOR_USER}; chgrp {AGGREGATOR_USER} the
# folder and its worker.*.key, chmod 750 / 640), then systemctl enable --now {PLANT_WORKER_UNIT}
[Unit]
Description=ioft plant worker {worker} (fleet {fleet})
After=network-online.target mosquitto.service
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={venv}/bin/cloud-aggregator worker --plant --id {worker} --config {toml}
User={AGGREGATOR_USER}
Group={AGGREGATOR_USER}
{_cloud_service_end(WATCHDOG_S["plant_worker"], "yes")}"""


def mosquitto_dropin(layout: FleetLayout, mosquitto: str = "/usr/sbin/mosquitto") -> str:
    """A drop-in for Debian's ``mosquitto.service``: the same service, on the fleet's config."""
    return f"""\
# ioft fleet {layout.fleet}: Debian's mosquitto.service runs this fleet's broker config.
# Install as /etc/systemd/system/{MOSQUITTO_DROPIN}, then systemctl daemon-reload;
# systemctl restart mosquitto.  (Started as root, mosquitto drops to its own user.)
[Service]
ExecStart=
ExecStart={mosquitto} -c {layout.mosquitto_conf}
"""


def install_script(fleet: str, device: str) -> str:
    """``install.sh`` in a device folder: what installing it on its Pi takes, as root, in one go."""
    dest = f"{DEVICE_ROOT}/{device}"
    return f"""\
#!/bin/sh
# ioft fleet {fleet}: install device {device} on this machine (as root), written by
# `cloud-aggregator fleet init`. It makes the system user {DEVICE_USER} (and the i2c group where there
# is none), copies this folder to {dest}/ (readable by root and {DEVICE_USER} only; an existing
# device.toml is kept, with your [sensors] edits), and installs the systemd units. Then:
#   systemctl enable --now ioft-edge-trainer@{device}
set -eu
src=$(cd "$(dirname "$0")" && pwd)
dest={dest}
getent group i2c >/dev/null || groupadd --system i2c
getent passwd {DEVICE_USER} >/dev/null || \
  useradd --system --user-group --home-dir /var/lib/ioft --shell /usr/sbin/nologin {DEVICE_USER}
install -d -m 0755 {DEVICE_ROOT}
install -d -o root -g {DEVICE_USER} -m 0750 "$dest"
for f in "$src"/*; do
  [ -f "$f" ] || continue
  name=$(basename "$f")
  if [ "$name" = device.toml ] && [ -e "$dest/device.toml" ]; then
    echo "kept $dest/device.toml (the new one is $f)"; continue
  fi
  install -o root -g {DEVICE_USER} -m 0640 "$f" "$dest/$name"
done
install -m 0644 "$src"/systemd/*.service /etc/systemd/system/
systemctl daemon-reload || true  # in a chroot systemd is not running: enabling still works
echo "installed {device}: systemctl enable --now ioft-edge-trainer@{device}" \
  "(and ioft-edge-recorder@{device} once $dest/device.toml has a [sensors] table)"
"""


def write_device_units(folder: Path, fleet: str, device: str, venv: Path = DEFAULT_VENV) -> None:
    """The device's two template units into ``folder/systemd/``, and ``install.sh`` (a device folder
    being written)."""
    write_file(folder / "systemd" / TRAINER_UNIT, trainer_unit(fleet, venv))
    write_file(folder / "systemd" / RECORDER_UNIT, recorder_unit(fleet, venv))
    write_file(folder / "install.sh", install_script(fleet, device))
    os.chmod(folder / "install.sh", 0o755)


def venv_of(layout: FleetLayout) -> Path:
    """The Python environment ``fleet init --venv`` named (read back from the aggregator's unit)."""
    try:
        text = (layout.root / "systemd" / AGGREGATOR_UNIT).read_text()
    except OSError:
        return DEFAULT_VENV
    found = re.search(r"^ExecStart=(\S+)/bin/cloud-aggregator ", text, re.MULTILINE)
    return Path(found.group(1)) if found else DEFAULT_VENV


def give_to_aggregator(root: Path) -> bool:
    """Let ``AGGREGATOR_USER``'s group read ``aggregator/`` (its key is 0600) when we are root and the
    user exists; ``False`` otherwise (``fleet init`` then prints the command)."""
    if os.geteuid() != 0:
        return False
    try:
        gid = grp.getgrnam(AGGREGATOR_USER).gr_gid
    except KeyError:
        return False
    folder = root / AGGREGATOR
    for path in (folder, *folder.rglob("*")):  # workers/: each aggregator worker's login
        os.chown(path, 0, gid)
        os.chmod(path, 0o750 if path.is_dir() else 0o640)
    return True


def write_fleet_units(layout: FleetLayout, root: Path, venv: Path = DEFAULT_VENV) -> None:
    """The aggregator's unit and mosquitto's drop-in into ``root/systemd/`` (``root``: the folder
    being written, which becomes ``layout.root``)."""
    write_file(root / "systemd" / AGGREGATOR_UNIT, aggregator_unit(layout, venv))
    write_file(root / "systemd" / MOSQUITTO_DROPIN, mosquitto_dropin(layout))

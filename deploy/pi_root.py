"""The arm64 Debian bookworm root the Pi check runs in (Raspberry Pi OS's base), under qemu-user-static.

Built once with ``debootstrap --arch=arm64 --foreign`` plus its second stage run through
binfmt_misc, then reused: each stage leaves a stamp file in the root.  Everything here runs
as root on the host; a failing step raises :class:`PiCheckError` with one line and the log.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
#: Host packages: the bootstrapper, the emulator and its binfmt registration, and the fleet's broker.
HOST_DEBS = {
    "debootstrap": "/usr/sbin/debootstrap",
    "qemu-user-static": "/usr/bin/qemu-aarch64-static",
    "binfmt-support": "/usr/sbin/update-binfmts",
    "mosquitto": "/usr/sbin/mosquitto",
}
#: In the root: Python 3.11 with venv and CAs for pip (debootstrap's --include), then mosquitto,
#: arecord (alsa-utils, the welder's capture tool) and ip (iproute2, as on Raspberry Pi OS) for the
#: tests that run them.
BOOTSTRAP_DEBS = ("python3", "python3-venv", "ca-certificates")
ROOT_DEBS = (*BOOTSTRAP_DEBS, "mosquitto", "alsa-utils", "iproute2")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
VENV = "/opt/ioft-venv"
#: The environment of every command in the root: nothing of the host's pip configuration
#: (its find-links are x86_64 wheel folders) leaks in.
ROOT_ENV = {
    "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_DEFAULT_TIMEOUT": "180",
    "PIP_NO_INPUT": "1",
    "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt",  # the venv's pip bundles certifi: use the root's CAs
}


@dataclass
class Install:
    """The device extra's venv in the root: pip's time, its size, pip freeze, the test tools added."""

    seconds: float
    venv_bytes: int
    freeze: list[str]
    test_tools: list[str]


class PiCheckError(Exception):
    """A step of the check failed; the message is the one line the operator sees."""


def run_logged(
    step: str, argv: Sequence[str], log: Path, *, env: dict[str, str] | None = None, timeout: float = 3600
) -> str:
    """Run ``argv``, appending its output to ``log``; its output, or :class:`PiCheckError` naming the step."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, env=env, timeout=timeout, errors="replace"
        )
    except subprocess.TimeoutExpired as exc:
        raise PiCheckError(f"{step}: still running after {timeout:.0f} s (log: {log})") from exc
    except OSError as exc:
        raise PiCheckError(f"{step}: cannot run {argv[0]}: {exc.strerror}") from exc
    with log.open("a") as out:
        out.write(done.stdout + done.stderr)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise PiCheckError(f"{step}: exit {done.returncode}: {last[:200]} (log: {log})")
    return done.stdout


def in_root(root: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``root`` (chroot execs it, so the process keeps the chroot's pid)."""
    return ["chroot", str(root), *argv]


def ensure_host_tools(log: Path) -> None:
    """Install from Debian what the check runs on the host, when missing."""
    missing = [deb for deb, path in HOST_DEBS.items() if not Path(path).exists()]
    if missing:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive"}
        run_logged("apt-get update (host)", ["apt-get", "update", "-qq"], log, env=env)
        run_logged(
            "apt-get install (host)", ["apt-get", "install", "-y", "-qq", *missing], log, env=env, timeout=900
        )


def ensure_binfmt(log: Path) -> str:
    """Mount binfmt_misc if needed and register qemu-aarch64; its registration line for the report."""
    if not (BINFMT / "status").exists():
        run_logged("mount binfmt_misc", ["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], log)
    entry = BINFMT / "qemu-aarch64"
    if not entry.exists():
        run_logged("register qemu-aarch64", ["update-binfmts", "--enable", "qemu-aarch64"], log)
    if not entry.exists():
        raise PiCheckError(
            f"qemu-aarch64 is not registered in {BINFMT} (update-binfmts --enable qemu-aarch64)"
        )
    fields = dict(line.split(" ", 1) for line in entry.read_text().splitlines() if " " in line)
    if "enabled" not in entry.read_text().splitlines()[0]:
        raise PiCheckError(f"{entry} is disabled: run update-binfmts --enable qemu-aarch64")
    if "F" not in fields.get("flags:", ""):  # without F the interpreter must exist inside the root
        raise PiCheckError(f"{entry} lacks the F flag: install Debian's qemu-user-static, which registers it")
    return f"{fields.get('interpreter', '?')} (flags {fields.get('flags:', '?').strip()})"


def ensure_root(root: Path, log: Path) -> str:
    """Build the bookworm arm64 root in two stages, or reuse it; says which."""
    stage1, stage2 = root / ".ioft-stage1-done", root / ".ioft-stage2-done"
    if stage2.exists():
        return "reused"
    if not stage1.exists():
        if root.exists() and any(root.iterdir()):
            raise PiCheckError(f"{root} holds a half-built root: remove it (rm -rf {root}) and run again")
        root.mkdir(parents=True, exist_ok=True)
        run_logged(
            "debootstrap (first stage)",
            ["debootstrap", "--arch=arm64", "--foreign", "--variant=minbase",
             f"--include={','.join(BOOTSTRAP_DEBS)}", SUITE, str(root), MIRROR],
            log, timeout=1800,
        )  # fmt: skip
        stage1.touch()
    run_logged(
        "debootstrap --second-stage (under qemu)",
        in_root(root, ["/debootstrap/debootstrap", "--second-stage"]),
        log,
        env=ROOT_ENV,
        timeout=3600,
    )
    stage2.touch()
    return "built"


@contextlib.contextmanager
def mounted(root: Path, log: Path) -> Iterator[None]:
    """/proc and a tmpfs /dev/shm in the root while the check runs.  Never /sys: onnxruntime's
    cpuinfo segfaults under qemu when it can read it (without it, it only warns)."""
    mounts = [(["-t", "proc", "proc"], root / "proc"), (["-t", "tmpfs", "tmpfs"], root / "dev" / "shm")]
    done: list[Path] = []
    try:
        for args, target in mounts:
            target.mkdir(parents=True, exist_ok=True)
            if subprocess.run(["mountpoint", "-q", str(target)]).returncode != 0:
                run_logged(f"mount {target}", ["mount", *args, str(target)], log)
                done.append(target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-l", str(target)], check=False)


def configure_root(root: Path, log: Path) -> None:
    """DNS, the host's extra CAs (pip's TLS goes through them here) and the root's Debian packages."""
    shutil.copyfile("/etc/resolv.conf", root / "etc" / "resolv.conf")
    extra = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    dest = root / "usr" / "local" / "share" / "ca-certificates"
    dest.mkdir(parents=True, exist_ok=True)
    changed = False
    for crt in extra:
        if not (dest / crt.name).exists() or (dest / crt.name).read_bytes() != crt.read_bytes():
            shutil.copyfile(crt, dest / crt.name)
            changed = True
    if changed:
        run_logged(
            "update-ca-certificates (root)", in_root(root, ["update-ca-certificates"]), log, env=ROOT_ENV
        )
    missing = [d for d in ROOT_DEBS if not _installed(root, d)]
    if missing:
        run_logged("apt-get update (root)", in_root(root, ["apt-get", "update", "-qq"]), log, env=ROOT_ENV)
        run_logged(
            "apt-get install (root)",
            in_root(root, ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]),
            log,
            env=ROOT_ENV,
            timeout=1800,
        )


def _installed(root: Path, deb: str) -> bool:
    status = root / "var" / "lib" / "dpkg" / "status"
    blocks = status.read_text(errors="replace").split("\n\n") if status.exists() else []
    return any(b.startswith(f"Package: {deb}\n") and "Status: install ok installed" in b for b in blocks)


def du_bytes(path: Path) -> int:
    """Bytes on disk under ``path`` (``du -sb``: apparent size, the figure pip users compare)."""
    return int(
        subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]
    )

"""Start an MQTT broker for a demo or a test: mosquitto when installed, else amqtt.

Both are real brokers speaking MQTT over TCP on loopback; nothing here is an
in-memory queue.  mosquitto runs with a generated loopback-only, anonymous config,
or with a fleet's TLS config from ``cloud-aggregator fleet init`` (``tls=True``);
amqtt runs in a child Python process (``python -m cloud_aggregator.local.broker --amqtt PORT``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


#: Ports this process handed out: nothing binds them until its caller starts a broker, so the kernel
#: may offer one again (a CI run got the devices' port back as the operator's: ``fleet init`` refused it).
_HANDED_OUT: set[int] = set()
#: ``"i/n"``: this process takes only ports ``p`` with ``p % n == i``, so that ``n`` processes started
#: together (pytest-xdist's workers: ``tests/conftest.py``) never hand out the same port.
PORT_SLICE_ENV = "IOFT_PORT_SLICE"
#: Where a slice's ports are drawn: below Linux's ephemeral range (32768-60999), which no outgoing
#: connection takes.  (The kernel's own choice, ``bind`` to port 0, prefers even ports: an odd slice
#: would wait for ever.)
SLICE_PORTS = range(20_000, 32_768)


def _port_slice() -> tuple[int, int]:
    try:
        i, n = (int(v) for v in os.environ.get(PORT_SLICE_ENV, "0/1").split("/"))
    except ValueError:
        return 0, 1
    return (i, n) if 0 <= i < n else (0, 1)


def _bound(port: int) -> int | None:
    """``port`` if it could be bound on 127.0.0.1 now (0: the kernel's choice), else ``None``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
        return s.getsockname()[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, not one this process handed out before, and
    in this process's slice (``PORT_SLICE_ENV``)."""
    if len(_HANDED_OUT) > 10_000:  # a long test session: the oldest are long bound or closed
        _HANDED_OUT.clear()
    i, n = _port_slice()
    draw, first = random.Random(), SLICE_PORTS.start + (i - SLICE_PORTS.start) % n  # the slice's least
    while True:
        port = _bound(0) if n == 1 else _bound(draw.randrange(first, SLICE_PORTS.stop, n))
        if port is not None and port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def find_mosquitto() -> str | None:
    """The mosquitto binary on PATH or in Debian's /usr/sbin."""
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None
    )


class PortTakenError(RuntimeError):
    """Another process answers on the port a broker was started on (it could not bind it)."""


class BrokerExitedError(RuntimeError):
    """The broker ended before it listened (its log says why; a port taken since it was drawn)."""


def listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` or one of its descendants (RabbitMQ's script starts the VM that listens)
    has a TCP socket listening on ``port`` (``None``: cannot tell: no psutil, the cloud extra's, or no
    right to read those processes' sockets)."""
    try:
        import psutil  # lazy: only where a broker is started here (the cloud side, a test, the demo)
    except ImportError:
        return None
    try:
        top = psutil.Process(pid)
        conns = [c for p in (top, *top.children(recursive=True)) for c in p.net_connections(kind="tcp")]
    except (psutil.Error, OSError):
        return None
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Return once ``port`` on 127.0.0.1 takes connections, and (given ``proc``) from ``proc``: a port
    another process took since it was drawn would otherwise pass for the broker (``PortTakenError``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerExitedError(f"broker exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                pass
        except OSError:
            time.sleep(0.02)
            continue
        if proc is None or listens(proc.pid, port) is not False:
            return
        raise PortTakenError(f"another process listens on 127.0.0.1:{port}, not the broker started there")
    raise RuntimeError(f"broker did not listen on 127.0.0.1:{port} within {timeout} s")


def interrupt_on_sigterm() -> None:
    """Make SIGTERM unwind the main thread like Ctrl-C (``KeyboardInterrupt``).

    A process that starts a broker and children stops them in ``finally``; the default
    SIGTERM action (a service manager, ``timeout``) ends it without running ``finally``
    and leaves them behind.
    """
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@dataclass
class BrokerProcess:
    """A running broker child process."""

    kind: str
    port: int
    proc: subprocess.Popen
    config: Path | None = None
    owns_config: bool = False
    tls: bool = False

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.owns_config and self.config is not None:
            self.config.unlink(missing_ok=True)

    def kill(self) -> None:
        """Stop abruptly, as a crashing broker would."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


LOOPBACK_CONF = """# ioft: a local broker for a demo or a test
listener {port} 127.0.0.1
allow_anonymous true
set_tcp_nodelay true
persistence false
"""


def start_mosquitto(
    port: int | None = None,
    *,
    config: Path | None = None,
    log_file: Path | None = None,
    tls: bool = False,
    as_invoker: bool = False,
) -> BrokerProcess:
    """mosquitto on 127.0.0.1 and ``port`` (anonymous, loopback only), or with the given ``config``
    (which must listen on ``port``; ``tls``: its listener speaks TLS, so ``url`` says ``mqtts://``).

    ``as_invoker``: keep running as the current user.  Started as root, mosquitto drops to
    the ``mosquitto`` user before reading keys, password file and ACL, which then fail to
    open from a private (0700) temp folder; a test runs it with a copy of ``config`` that
    names the current user instead (no effect when not root).

    ``set_tcp_nodelay``: rounds are small request/response exchanges, and Nagle's
    algorithm against delayed ACKs would add ~40 ms to every hop.

    A port it drew itself (``port`` not given) that another process takes before mosquitto binds it
    is drawn again (``DRAWS``); a given one raises :class:`PortTakenError`.
    """
    binary = find_mosquitto()
    if binary is None:
        raise FileNotFoundError("mosquitto not found; install it (apt-get install mosquitto) or use amqtt")
    if config is not None and port is None:
        raise ValueError("start_mosquitto(config=...) needs the port that config listens on")
    drawn = port is None  # ours to draw again where another process takes it first
    for attempt in range(1, DRAWS + 1):
        port = port or free_port()
        try:
            return _mosquitto(binary, port, config, log_file, tls, as_invoker)
        except (PortTakenError, BrokerExitedError) as exc:
            if not drawn or attempt == DRAWS:
                raise
            log.warning("mosquitto on a drawn port: %s; drawing another", exc)
            port = None
    raise AssertionError("unreachable")


#: Ports :func:`start_mosquitto` draws before it gives up (another process may take one between the
#: draw and mosquitto's bind: a test session beside another, an outgoing connection).
DRAWS = 3


def _mosquitto(
    binary: str, port: int, config: Path | None, log_file: Path | None, tls: bool, as_invoker: bool
) -> BrokerProcess:
    owns_config = config is None or as_invoker
    if config is not None and as_invoker:
        fd, name = tempfile.mkstemp(prefix="ioft-mosquitto-", suffix=".conf")
        with os.fdopen(fd, "w") as fh:
            fh.write(f"user {pwd.getpwuid(os.geteuid()).pw_name}\n" + config.read_text())
        config = Path(name)
    elif config is None:
        fd, name = tempfile.mkstemp(prefix="ioft-mosquitto-", suffix=".conf")
        with os.fdopen(fd, "w") as fh:
            fh.write(LOOPBACK_CONF.format(port=port))
        config = Path(name)
    args = [binary, "-c", str(config)]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    broker = BrokerProcess("mosquitto", port, proc, config, owns_config, tls)
    try:
        wait_for_port(port, 10.0, proc)
    except BaseException:
        broker.stop()
        raise
    return broker


def start_amqtt(port: int | None = None, *, log_file: Path | None = None) -> BrokerProcess:
    """amqtt (MQTT 3.1.1, pure Python) in a child process on 127.0.0.1."""
    port = port or free_port()
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloud_aggregator.local.broker", "--amqtt", str(port)],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for_port(port, 20.0, proc)
    return BrokerProcess("amqtt", port, proc)


def start_embedded(
    port: int | None = None, *, prefer: str = "mosquitto", log_file: Path | None = None
) -> BrokerProcess:
    """mosquitto if its binary is present (and preferred), else amqtt."""
    if prefer == "mosquitto" and find_mosquitto():
        return start_mosquitto(port, log_file=log_file)
    return start_amqtt(port, log_file=log_file)


def _run_amqtt(port: int) -> None:
    # Lazy: amqtt is the optional `broker` extra, needed only where no mosquitto is installed.
    from amqtt.broker import Broker

    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}", "max_connections": 10_000}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }

    async def main() -> None:
        broker = Broker(config)
        await broker.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await broker.shutdown()

    asyncio.run(main())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Run an embedded amqtt broker on 127.0.0.1")
    parser.add_argument("--amqtt", type=int, required=True, metavar="PORT")
    logging.basicConfig(level=logging.WARNING)
    _run_amqtt(parser.parse_args().amqtt)

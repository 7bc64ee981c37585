"""``cloud-aggregator console``: the live fleet console in a browser, and the fleet's ``/metrics``.

A process of its own beside ``serve``: it reads the aggregator's store read-only and
the devices' retained statuses over its own MQTT session (the operator's login from
``--config``, as one of the operator's logins, its client id: up to sixteen consoles and commands run beside ``serve``;
the aggregator's own login is refused, as it would knock ``serve`` off the broker), so the
round loop never waits on it.  Served by uvicorn on loopback by
default; bound to any other address it wants a token (``--token``, or one it makes up
and prints).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.operator import DefaultsHelpFormatter, add_session_args, fleet_root_of, operator_config
from ioft_protocol.cli import check_broker_login
from ioft_protocol.config import ConfigError

log = logging.getLogger(__name__)
DEFAULT_PORT = 8765
CONSOLE_CMD = (sys.executable, "-m", "cloud_aggregator.cli", "console")


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (``0.0.0.0`` and names of this machine are not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def console_config(args: argparse.Namespace) -> AggregatorConfig:
    """The operator's TOML (broker login, fleet, the aggregator's state_dir) with the command line's
    overrides; ``ConfigError`` if invalid or the aggregator's own login."""
    return operator_config(args)


def check_token(host: str, token: str | None) -> str | None:
    """The token to require: ``token``; a new one off loopback; ``None`` on loopback without one.

    Raises
    ------
    ConfigError
        An empty ``--token``: no token would let anyone in.
    """
    if token is not None and not token.strip():
        raise ConfigError("command line", ["--token: empty; give one, or leave it out to get a new one"])
    if token is None and not is_loopback(host):
        return secrets.token_urlsafe(24)
    return token


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port), so the printed URL names the real port."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(64)
    return sock


def bracketed(host: str) -> str:
    """``host`` as a URL or Host header writes it (an IPv6 address in brackets)."""
    return f"[{host.strip('[]')}]" if ":" in host else host


def url(host: str, port: int, token: str | None) -> str:
    return f"http://{bracketed(host)}:{port}/" + (f"?token={token}" if token else "")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "console",
        help="live fleet console in the browser (the machines: answers, alerts; learning: curves, rounds) and /metrics",
        formatter_class=DefaultsHelpFormatter,
    )
    add_session_args(p)
    p.add_argument("--state-dir", help="the aggregator's state folder (default: --config's state_dir)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (not loopback: a token is required)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free one)")
    p.add_argument("--token", help="token every request must carry (off loopback, none given: one is made)")
    p.add_argument("--refresh", type=float, default=1.0, help="seconds between checks for news")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    # A mistake here is a ConfigError: `entry_point` prints it on one line and exits 2.
    cfg = console_config(args)
    check_broker_login(cfg, f"ioft-console-{args.port}", str(args.config or "command line"))
    token = check_token(args.host, args.token)
    if not 0 < args.refresh <= 60:
        raise ConfigError("command line", [f"--refresh: {args.refresh} s; give 0 < seconds <= 60"])
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(f"cannot serve on {args.host} port {args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    # The web stack is the cloud extra's: imported here, so that every other `cloud-aggregator`
    # command (fleet init, push, status...) runs where only the device extra is installed.
    import uvicorn

    from cloud_aggregator.console.app import LOOPBACK_HOSTS, build_app
    from cloud_aggregator.console.feed import StatusFeed, ViewSource

    feed = StatusFeed(cfg, cfg.fleet)
    feed.start()
    source = ViewSource(
        Path(cfg.state_dir) / "aggregator.sqlite", feed, cfg.fleet, fleet_root_of(args.config)
    )
    hosts = (*LOOPBACK_HOSTS, bracketed(args.host)) if is_loopback(args.host) else None
    app = build_app(source, token=token, hosts=hosts, refresh_s=args.refresh)
    port = sock.getsockname()[1]
    # In one write: print's separate newline could let the MQTT session's log (stderr, often
    # the same pipe) land between the URL and its end of line, and a reader take the wrong word.
    bearer = " (Authorization: Bearer <token>)" if token else ""
    sys.stdout.write(
        f"console: {url(args.host, port, token)}\nmetrics: {url(args.host, port, None)}metrics{bearer}\n"
    )
    sys.stdout.flush()
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, access_log=False)
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    # that was there before: let that one end us with status 0 (SIGTERM) or 130 (Ctrl-C).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        return 130
    finally:
        feed.stop()
        sock.close()
    return 0


def launch(
    config: Path, log: Path, *, port: int = DEFAULT_PORT, refresh: float = 1.0
) -> tuple[subprocess.Popen, str]:
    """``cloud-aggregator console --config config`` as a child process (the demo's, a benchmark's).

    Returns the process and its URL; ``ConsoleStartError`` (with the log's tail) when it exits
    before printing one (a port in use, a config it refuses).
    """
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [*CONSOLE_CMD, "--config", str(config), "--port", str(port), "--refresh", str(refresh)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    first = proc.stdout.readline() if proc.stdout is not None else ""
    if not first.startswith("console: "):
        proc.wait(10)
        raise ConsoleStartError(
            f"the console did not start: {log.read_text(errors='replace')[-500:].strip()}"
        )
    return proc, first.split()[-1]


class ConsoleStartError(RuntimeError):
    """``cloud-aggregator console`` exited before serving."""

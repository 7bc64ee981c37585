"""RabbitMQ nodes with the MQTT plugin on loopback, for the tests and the benchmarks: one node,
or a cluster of several, each started and stopped here like :func:`cloud_aggregator.local.broker.start_mosquitto`.

Debian's ``rabbitmq-server`` (3.10; MQTT 3.1.1 only) is started from
``/usr/lib/rabbitmq/bin`` (the ``/usr/sbin`` wrappers switch to the ``rabbitmq`` user and its
cookie), with everything of its own in one folder: node names ``<prefix>-<i>@localhost``, their
data and logs, a ``HOME`` holding the cluster's Erlang cookie, and an ``epmd`` started here on a
free loopback port (``ERL_EPMD_PORT``), so nothing collides with a system node, another test
run or another cluster.  Every listener is on 127.0.0.1 and a free port: MQTT, and the Erlang
distribution the nodes and ``rabbitmqctl`` talk over; AMQP is off.

MQTT logins: anonymous clients are RabbitMQ's ``guest`` user (allowed on loopback only), as on
the anonymous mosquitto of the tests; ``users`` adds password users with full rights on ``/``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cloud_aggregator.local.broker import free_port, wait_for_port

#: Where Debian's package puts the node's start script and CLI tools.
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
#: Seconds a node has to open its MQTT port (~9 s on an idle 2-core machine).
START_TIMEOUT_S = 90.0

NODE_CONF = """# ioft: a RabbitMQ node for a test (MQTT plugin, loopback only)
listeners.tcp = none
mqtt.listeners.tcp.default = 127.0.0.1:{mqtt_port}
mqtt.allow_anonymous = true
mqtt.default_user = guest
mqtt.default_pass = guest
mqtt.vhost = /
mqtt.exchange = amq.topic
loopback_users.guest = true
log.file.level = info
log.console = false
"""


def find_rabbitmq() -> Path | None:
    """The node start script of Debian's ``rabbitmq-server`` package, if installed."""
    script = RABBITMQ_BIN / "rabbitmq-server"
    return script if os.access(script, os.X_OK) else None


class RabbitError(RuntimeError):
    """A node did not start, join or stop; the message quotes what ``rabbitmqctl`` or the log said."""


@dataclass
class RabbitNode:
    """One running node: its MQTT port, its Erlang node name and the environment its CLI needs."""

    name: str
    port: int
    dist_port: int
    env: dict[str, str]
    proc: subprocess.Popen
    log_file: Path

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl -n <node> args...``; its output, or :class:`RabbitError` naming the failure."""
        env = dict(self.env)
        # The CLI's own distribution port (by default the node's + 10000, which may pass 65535).
        ctl_port = free_port()
        env["RABBITMQ_CTL_DIST_PORT_MIN"] = env["RABBITMQ_CTL_DIST_PORT_MAX"] = str(ctl_port)
        done = subprocess.run(
            [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.name, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RabbitError(
                f"rabbitmqctl {' '.join(args)} on {self.name}: {done.stderr.strip() or done.stdout}"
            )
        return done.stdout

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the node (SIGTERM; SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """Stop abruptly, as a crashing node would (the whole process group: beam and its helpers)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class RabbitCluster:
    """Nodes sharing one cookie and one ``epmd``; ``nodes[0]`` is the one the others joined."""

    root: Path
    epmd: subprocess.Popen
    nodes: list[RabbitNode] = field(default_factory=list)

    def stop(self) -> None:
        """Stop every node, then the ``epmd`` started for them."""
        for node in reversed(self.nodes):
            node.stop()
        if self.epmd.poll() is None:
            self.epmd.terminate()
            try:
                self.epmd.wait(5)
            except subprocess.TimeoutExpired:
                self.epmd.kill()
                self.epmd.wait()

    def __enter__(self) -> RabbitCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _epmd_binary() -> str:
    found = shutil.which("epmd") or next(iter(sorted(Path("/usr/lib/erlang").glob("erts-*/bin/epmd"))), None)
    if found is None:
        raise RabbitError("epmd not found (it comes with erlang-base, a dependency of rabbitmq-server)")
    return str(found)


def start_cluster(
    root: Path,
    size: int = 1,
    *,
    users: Mapping[str, str] | None = None,
    prefix: str | None = None,
) -> RabbitCluster:
    """Start ``size`` nodes under ``root`` and cluster them (``join_cluster`` on the first one).

    Parameters
    ----------
    root
        A folder of this run's own (data, logs, cookie, configs); created if missing.
    size
        Nodes in the cluster (1: a single node).
    users
        ``{username: password}`` MQTT users to add, with full rights on ``/`` (anonymous logins
        work either way).
    prefix
        The node names' prefix (default: ``ioft-`` and a random token).

    Raises
    ------
    FileNotFoundError
        ``rabbitmq-server`` is not installed.
    RabbitError
        A node did not start or join; the message says which and quotes its log's last lines.
    """
    script = find_rabbitmq()
    if script is None:
        raise FileNotFoundError("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
    home = _erlang_home(root)
    epmd_port = free_port()
    epmd = _start_epmd(epmd_port)
    cluster = RabbitCluster(root, epmd)
    prefix = prefix or f"ioft-{secrets.token_hex(3)}"
    try:
        wait_for_port(epmd_port, 10.0, epmd)
        # Starting the nodes side by side takes one start-up time, not `size` of them.
        starting = [_launch(script, root, home, epmd_port, f"{prefix}-{i}@localhost") for i in range(size)]
        cluster.nodes.extend(starting)
        for node in starting:
            _wait_started(node)
        for node in cluster.nodes[1:]:
            _join(node, cluster.nodes[0])
        _add_users(cluster.nodes[0], users or {})
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start_epmd(port: int) -> subprocess.Popen:
    """The cluster's own Erlang port mapper, on loopback ``port`` (not the system's 4369)."""
    return subprocess.Popen(
        [_epmd_binary(), "-port", str(port), "-address", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _add_users(node: RabbitNode, users: Mapping[str, str]) -> None:
    """``{username: password}`` as users with full rights on ``/`` (the cluster shares them)."""
    for user, password in users.items():
        node.ctl("add_user", user, password)
        node.ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")


def _erlang_home(root: Path) -> Path:
    """``root/home``: the nodes' HOME, with the Erlang cookie they share (made once, owner-read only)."""
    root.mkdir(parents=True, exist_ok=True)
    home = root / "home"
    home.mkdir(exist_ok=True)
    cookie = home / ".erlang.cookie"
    if not cookie.exists():
        cookie.write_text(secrets.token_hex(20))
        cookie.chmod(0o400)
    return home


def _join(node: RabbitNode, first: RabbitNode) -> None:
    """Reset ``node`` and join it to ``first``'s cluster; back once its MQTT port listens again."""
    node.ctl("stop_app")
    node.ctl("reset")
    node.ctl("join_cluster", first.name)
    node.ctl("start_app")
    wait_for_port(node.port, START_TIMEOUT_S, node.proc)


def _launch(script: Path, root: Path, home: Path, epmd_port: int, name: str) -> RabbitNode:
    short = name.split("@")[0]
    base = root / short
    base.mkdir(exist_ok=True)
    port, dist_port = free_port(), free_port()
    conf = base / "rabbitmq.conf"
    conf.write_text(NODE_CONF.format(mqtt_port=port))
    plugins = base / "enabled_plugins"
    plugins.write_text("[rabbitmq_mqtt].\n")
    env_file = base / "rabbitmq-env.conf"
    env_file.write_text("")  # not Debian's /etc/rabbitmq/rabbitmq-env.conf
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": str(home),
        "ERL_EPMD_PORT": str(epmd_port),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODENAME": name,
        "RABBITMQ_USE_LONGNAME": "false",
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
        "RABBITMQ_LOG_BASE": str(base / "log"),
        "RABBITMQ_CONFIG_FILE": str(conf),
        "RABBITMQ_CONF_ENV_FILE": str(env_file),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(plugins),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),
        "RABBITMQ_PID_FILE": str(base / "rabbit.pid"),
    }
    log_file = base / "stdout.log"
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(
            [str(script)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return RabbitNode(name, port, dist_port, env, proc, log_file)


def _wait_started(node: RabbitNode) -> None:
    try:
        wait_for_port(node.port, START_TIMEOUT_S, node.proc)
    except RuntimeError as exc:
        tail = _log_tail(node)
        raise RabbitError(f"RabbitMQ node {node.name} did not start: {exc}; its log ends: {tail}") from None


def _log_tail(node: RabbitNode, lines: int = 5) -> str:
    texts: Sequence[Path] = [node.log_file, *sorted(Path(node.env["RABBITMQ_LOG_BASE"]).glob("*.log"))]
    out = []
    for path in texts:
        try:
            out += path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
    return " | ".join(line.strip() for line in out if line.strip()) or "(empty)"

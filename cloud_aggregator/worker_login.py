"""Which login an aggregator worker connects with: its own, from ``workers/<id>.toml`` beside the config.

A fleet's broker (``fleet init``) makes each login's identity (certificate CN or password-file user)
its username and its client id (``use_username_as_clientid``): K workers logging in with the
aggregator's certificate or password would be one client, each connection taking over the last,
and serve's too.  ``fleet init --workers K`` and ``fleet add-worker --id <id>`` write each worker's own
login, ``aggregator/workers/<id>.toml`` (:func:`cloud_aggregator.fleet.identity.worker_login_toml`):
``username``/``password``, or ``[tls] cert_file``/``key_file``.  ``cloud-aggregator worker --config
aggregator.toml --id <id>`` (and so each worker ``serve`` starts) puts it in place of the config's own
login; everything else stays the config's.  A config that logs in as nobody (a test or loopback
broker) needs no worker login.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ioft_protocol.config import ConfigError, load_toml

#: The folder beside the aggregator's config (``aggregator/``) that holds the workers' logins.
WORKERS_DIR = "workers"
_KEYS = {"username", "password", "tls"}
_TLS_KEYS = {"cert_file", "key_file"}


def login_path(config: Path, worker: str) -> Path:
    return Path(config).resolve().parent / WORKERS_DIR / f"{worker}.toml"


def identity(username: str | None, cert_file: str | None) -> str | None:
    """Who a config logs in as: ``the certificate PATH``, ``user NAME``, or ``None`` (nobody)."""
    if cert_file:
        return f"the certificate {cert_file}"
    return f"user {username}" if username else None


def raw_identity(raw: Mapping[str, Any]) -> str | None:
    """:func:`identity` of a config's raw TOML."""
    tls = raw.get("tls")
    return identity(raw.get("username"), tls.get("cert_file") if isinstance(tls, Mapping) else None)


def with_login(raw: dict[str, Any], config: Path, worker: str) -> tuple[dict[str, Any], bool]:
    """``raw`` (the aggregator's config) with worker ``worker``'s own login in place of its login, and
    whether the worker has one.

    Raises
    ------
    ConfigError
        The login file does not parse, or holds more than a login.
    """
    path = login_path(config, worker)
    if not path.exists():
        return raw, False
    login = load_toml(path)
    tls = login.get("tls", {})
    extra = sorted(set(login) - _KEYS) + sorted(f"tls.{k}" for k in set(tls) - _TLS_KEYS)
    if extra or not isinstance(tls, dict):
        raise ConfigError(str(path), [f"{path}: a worker login holds username, password or [tls] cert_file, key_file; "
                           f"not {', '.join(extra) or 'tls'}"])  # fmt: skip
    out = {k: v for k, v in raw.items() if k not in ("username", "password")}
    out.update({k: login[k] for k in ("username", "password") if k in login})
    old_tls = {k: v for k, v in dict(raw.get("tls") or {}).items() if k not in _TLS_KEYS}
    if old_tls or tls:
        out["tls"] = {**old_tls, **tls}
    return out, True


def fleet_hint(config: Path) -> str:
    """The fleet folder a config sits in (``<fleet>/aggregator/aggregator.toml``), for a command to print."""
    folder = Path(config).resolve().parent
    return str(folder.parent) if folder.name == "aggregator" else "<the fleet folder>"


def missing_logins(who: str | None, config: Path, workers: Sequence[str]) -> str | None:
    """One line refusing to start ``workers`` on ``config`` when it logs in as someone (``who``:
    :func:`identity`) and a worker has no login of its own (``None``: each has one, or nobody)."""
    if who is None:
        return None
    missing = [w for w in workers if not login_path(config, w).exists()]
    if not missing:
        return None
    ids = ",".join(missing)
    return (
        f"worker {ids} {'has' if len(missing) == 1 else 'have'} no login of its own "
        f"({login_path(config, missing[0]).parent}/<id>.toml) and would log in as {who}, which the broker "
        f"makes one client with serve's: run `cloud-aggregator fleet add-worker --dir {fleet_hint(config)} "
        f"--id {ids}` and reload the broker"
    )

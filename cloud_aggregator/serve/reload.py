"""What tells a running ``serve`` to stop or to re-read its config, and the configured tasks
checked against the store and recorded in it, at start-up and at each reload (``SIGHUP``)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from cloud_aggregator.config import AggregatorConfig, TaskConfig
from cloud_aggregator.store.sqlite import SqliteStore, TaskChangedError
from ioft_protocol.config import ConfigError

__all__ = [
    "Control",
    "ServeRefusedError",
    "TaskChangedError",
    "Terminated",
    "check_tasks",
    "register_tasks",
    "reloads",
]

log = logging.getLogger("cloud_aggregator.serve.server")  # serve's lines keep their logger name


class ServeRefusedError(ValueError):
    """An operator's config that ``serve`` refuses before it connects or writes; one line."""


class Terminated(BaseException):
    """Raised in the main thread by the ``SIGTERM`` handler: stop now (each round is saved as it ends)."""


@dataclass
class Control:
    """How a running ``serve --service`` is asked to re-read its config.

    Attributes
    ----------
    reload
        Reads and validates the config again (raises ``ConfigError``); ``None``: no reloads.
    reload_requested
        Set by the ``SIGHUP`` handler; a watcher thread then calls ``reload``.
    """

    reload: Callable[[], AggregatorConfig] | None = None
    reload_requested: threading.Event = field(default_factory=threading.Event)


def check_tasks(store: SqliteStore, tasks: list[TaskConfig], restart: Callable[[str], bool]) -> None:
    """Refuse every task whose spec changed in a way that voids its stored history.

    Raises
    ------
    ServeRefusedError
        One line naming each refused task, its changed fields and the way forward.
    """
    refused = []
    for task in tasks:
        if restart(task.name):
            continue
        try:
            store.check_task(task.name, task.spec().to_json())
        except TaskChangedError as exc:
            refused.append(str(exc))
    if refused:
        raise ServeRefusedError("; ".join(refused))


def register_tasks(store: SqliteStore, tasks: list[TaskConfig], restart: Callable[[str], bool]) -> None:
    """Record each task's spec; a restarted one loses its history, after a line saying what."""
    for task in tasks:
        spec = task.spec()
        if restart(task.name):
            stored = store.task_spec(task.name)
            what = (
                "nothing was stored" if stored is None else f"deleting {store.history(task.name).describe()}"
            )
            log.warning("task %s: --restart: %s; starting it afresh", task.name, what)
        if store.register_task(spec.name, spec.to_json(), restart=restart(task.name)):
            log.info("task %s: resuming from the stored state", spec.name)


def _one_line(exc: Exception) -> str:
    if isinstance(exc, ConfigError):
        return "; ".join(exc.errors)
    return str(exc).replace("\n", " ")


def _settings_changed(old: AggregatorConfig, new: AggregatorConfig) -> list[str]:
    return [
        f.name
        for f in fields(old)
        if f.name not in ("task", "restart", "resume_from_devices")
        and getattr(old, f.name) != getattr(new, f.name)
    ]


def _watch_reloads(
    control: Control, store: SqliteStore, cfg: AggregatorConfig, accepted: queue.Queue[AggregatorConfig]
) -> None:
    """Serve ``SIGHUP``s: validate the re-read config; queue it, or refuse it in one line."""
    assert control.reload is not None
    while True:
        control.reload_requested.wait()
        control.reload_requested.clear()
        try:
            new = control.reload()
            check_tasks(store, new.task, lambda _: False)
        except (ConfigError, ServeRefusedError, ValueError, OSError) as exc:
            log.error("SIGHUP: config refused, the running tasks go on: %s", _one_line(exc))
            continue
        changed = _settings_changed(cfg, new)
        if changed:
            log.warning("SIGHUP: %s changed; they apply when serve is started again", ", ".join(changed))
        log.info("SIGHUP: config accepted: tasks %s", [t.name for t in new.task])
        accepted.put(new)


def reloads(control: Control, store: SqliteStore, cfg: AggregatorConfig) -> queue.Queue[AggregatorConfig]:
    """Where the configs each reload brings (checked against the store) arrive, from a watcher
    thread when ``control`` can reload; else a queue that stays empty."""
    accepted: queue.Queue[AggregatorConfig] = queue.Queue()
    if control.reload is not None:
        threading.Thread(
            target=_watch_reloads, args=(control, store, cfg, accepted), name="reload", daemon=True
        ).start()
    return accepted

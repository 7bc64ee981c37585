"""What every console script does with an error: one line on stderr and an exit status, no traceback.

The three entry points (``edge-trainer``, ``edge-recorder``, ``cloud-aggregator``) wrap their
``main`` with :func:`entry_point`; it is the one place that maps our error types to what an
operator sees.  A *user mistake* (a config that does not validate, a manifest that does not
verify, a broker URL that cannot work) exits :data:`USAGE` (2, as argparse does for a bad
flag); a *runtime failure* (the broker refused us, the state store is unusable, a file could
not be written) exits :data:`FAILURE` (1).  Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import functools
import io
import sys
from collections.abc import Callable, Sequence
from pathlib import PurePath
from typing import Any, TextIO

from ioft_protocol.config import ConfigError
from ioft_protocol.manifest import ManifestError
from ioft_protocol.mqtt_options import BrokerLogin, MqttError, SessionOptions
from ioft_protocol.mqtt_tls import check_options
from ioft_protocol.state import StateError

USAGE = 2
"""Exit status for a user mistake: the line says what to fix."""

FAILURE = 1
"""Exit status for a runtime failure: the line says what failed."""

USER_MISTAKES: tuple[type[Exception], ...] = (ConfigError, ManifestError)
"""Our error types that always mean the operator gave something that cannot work."""

RUNTIME_FAILURES: tuple[type[Exception], ...] = (MqttError, StateError, OSError)
"""Our error types (and the OS's) for a world that did not cooperate."""

Main = Callable[[Sequence[str] | None], int]


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line: a multi-line list (``ConfigError``) joined with ``;``.

    Parameters
    ----------
    exc
        The error to describe.

    Returns
    -------
    str
        The message's lines, stripped of list bullets, joined into one line.
    """
    lines = [ln.strip().removeprefix("- ") for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    head, rest = lines[0], lines[1:]
    if not rest:
        return head
    return head + (" " if head.endswith(":") else ": ") + "; ".join(rest)


def whole_lines(stream: TextIO) -> None:
    """Make each ``print`` to ``stream`` reach the OS as one write of whole lines.

    Unbuffered (``python -u``, ``PYTHONUNBUFFERED``, as tests and services run us), ``print(x)``
    is two writes, ``x`` then ``"\\n"``; a log line from another thread sharing the pipe (stdout
    and stderr merged, as in a journal) then lands inside the printed line.  Line buffering
    flushes ``x\\n`` in one write instead.

    Parameters
    ----------
    stream
        A text stream; only a :class:`io.TextIOWrapper` is changed.
    """
    if isinstance(stream, io.TextIOWrapper):
        stream.reconfigure(line_buffering=True, write_through=False)


def run_cli(
    prog: str,
    main: Main,
    argv: Sequence[str] | None = None,
    *,
    mistakes: tuple[type[Exception], ...] = (),
    failures: tuple[type[Exception], ...] = (),
) -> int:
    """Run ``main(argv)``; map a user mistake to one line and exit 2, a runtime failure to one line and 1.

    Parameters
    ----------
    prog
        The console script's name, the prefix of the line.
    main
        The script's body; returns its exit status.
    argv
        Arguments (``None``: ``sys.argv[1:]``).
    mistakes, failures
        The script's own error types, added to :data:`USER_MISTAKES` and :data:`RUNTIME_FAILURES`.

    Returns
    -------
    int
        ``main``'s status, :data:`USAGE` or :data:`FAILURE`.
    """
    try:
        return main(argv)
    except (*USER_MISTAKES, *mistakes) as exc:
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return USAGE
    except (*RUNTIME_FAILURES, *failures) as exc:
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return FAILURE


def entry_point(
    prog: str,
    *,
    mistakes: tuple[type[Exception], ...] = (),
    failures: tuple[type[Exception], ...] = (),
) -> Callable[[Main], Main]:
    """Decorate a console script's ``main(argv) -> int`` with :func:`run_cli`.

    Parameters
    ----------
    prog
        The console script's name.
    mistakes, failures
        The script's own error types for user mistakes (exit 2) and runtime failures (exit 1).

    Returns
    -------
    Callable
        The decorator.
    """

    def deco(main: Main) -> Main:
        @functools.wraps(main)
        def wrapped(argv: Sequence[str] | None = None) -> int:
            for stream, ours in ((sys.stdout, sys.__stdout__), (sys.stderr, sys.__stderr__)):
                if stream is ours:  # the process's own, not a caller's capture
                    whole_lines(stream)
            return run_cli(prog, main, argv, mistakes=mistakes, failures=failures)

        return wrapped

    return deco


def check_broker_login(login: BrokerLogin, client_id: str, source: str) -> None:
    """Refuse, as a config error, a broker login no session could use -- before anything connects.

    The session's own checks run (URL form, plaintext without ``allow_plaintext``, a TLS
    URL without a CA, TLS files with a plaintext URL, TLS files that do not load), without
    building a client.

    Parameters
    ----------
    login
        The config's broker, credentials and TLS files.
    client_id
        The id the session would use.
    source
        Where the config came from (a file name, or "command line"), for the message.

    Raises
    ------
    ConfigError
        One problem, naming the ``broker`` setting and what to do.
    """
    try:
        check_options(SessionOptions.for_login(login, client_id))
    except (ValueError, MqttError) as exc:
        raise ConfigError(source, [f"broker: {exc}"]) from None


def flags_over_toml(raw: dict[str, Any], args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """``raw`` (a config file's table, changed in place and returned) with each of ``names`` given on
    the command line in place of the file's field of the same name: flags win over the TOML.

    A flag left out (``None``, an unset switch, an empty list), or one this command's parser lacks,
    leaves the file's value; a switch (``--allow-plaintext``) sets its field true, a path is written
    as text and a repeated flag as a list, as a TOML file would hold them.
    """
    for name in names:
        value = getattr(args, name, None)
        if not value:
            continue
        if isinstance(value, PurePath):
            value = str(value)
        elif isinstance(value, tuple | list):
            value = list(value)
        raw[name] = value
    return raw

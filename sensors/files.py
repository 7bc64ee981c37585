"""Files the device did not write: read without following a link, sized before they are read,
named in one line.

Weld exports land in a folder that the welder's monitoring system (or a network share) writes,
and ``edge-trainer predict`` reads whatever path it is given.  Three rules keep such a file from
turning against the device:

* **No links.**  The last part of the path is opened with ``O_NOFOLLOW``: a planted symbolic
  link is refused, never followed.  Resolving a link and checking that it ends at a regular file
  would not be enough: the device's own key (``<state_dir>/tls/*.key``) is a regular file.
* **A cap before any allocation.**  The file's size (and, by the readers, what its header
  declares) is checked against ``max_bytes`` first, so a sparse 1 GiB WAV that takes 4 KB of disk
  is refused in one line instead of being decoded into gigabytes of memory.
* **Descriptions, never contents.**  A refusal says what the file *is* (a directory, a character
  device, too large) and never quotes a byte of it; names pass through :func:`printable`, so a
  file name holding a newline cannot add a line to a log.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

DEFAULT_MAX_FILE_BYTES = 32 * 1024 * 1024
"""Largest weld or rows file read by default: a 4-channel 200 kHz float32 weld of 10 s (welds last
under 2 s); decoded to float64 it takes at most 8 times this in memory."""

SIDECAR_MAX_BYTES = 1024 * 1024
"""Largest JSON sidecar read: a few named fields, never megabytes."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


class FileRefusedError(ValueError):
    """A path that is not a readable regular file within the cap; the message says what it is."""


def printable(text: object) -> str:
    """``text`` with every control or unprintable character escaped, so it stays one line.

    Parameters
    ----------
    text
        A file name, a path, a message holding them; anything ``str()`` takes.

    Returns
    -------
    str
        The text, with a newline as the two characters ``\\`` ``n`` and so on; printable characters
        (accented letters, ``\\`` itself) are kept, so escaping twice changes nothing.
    """
    s = str(text)
    if s.isprintable():
        return s
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in s
    )


def kind_of(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words: ``"a directory"``, ``"a regular file"``..."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def read_capped(path: str | Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES, *, setting: str = "") -> bytes:
    """The bytes of the regular file ``path``, refusing links, other kinds and files over ``max_bytes``.

    Parameters
    ----------
    path
        The file; its last part must not be a symbolic link.
    max_bytes
        The cap, checked against the file's size before anything is read.
    setting
        The config setting that raises the cap (named in the refusal), e.g. ``"[serve] max_file_bytes"``.

    Raises
    ------
    FileRefusedError
        Missing, a link, not a regular file, or over the cap: one line naming the path (escaped).
    OSError
        Any other failure to open or read (permissions), with the path escaped.
    """
    shown = printable(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang us
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileRefusedError(f"{shown}: no such file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileRefusedError(
                f"{shown}: is a symbolic link; links are refused (one could point at the device's keys): "
                "give the file itself"
            ) from None
        raise OSError(exc.errno, f"{shown}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefusedError(f"{shown}: is {kind_of(st.st_mode)}, not a file")
        check_size(path, st.st_size, max_bytes, setting=setting)
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1)  # a file still growing is stopped at the cap as well
    finally:
        os.close(fd)
    check_size(path, len(data), max_bytes, setting=setting)
    return data


def check_size(path: str | Path, size: int, max_bytes: int, *, what: str = "", setting: str = "") -> None:
    """Refuse ``size`` bytes (of the file, or ``what`` its header declares) above ``max_bytes``.

    Raises
    ------
    FileRefusedError
        One line with both numbers and the setting that raises the cap.
    """
    if size > max_bytes:
        raise_with = f" (raise {setting} if such files are real)" if setting else ""
        raise FileRefusedError(
            f"{printable(path)}: {what or 'is'} {size} bytes, more than the {max_bytes} this device "
            f"reads{raise_with}"
        )

"""A folder's listing, made again only when the folder changed (its inode and mtime).

A daemon asks for its dataset folder's segments once per round (``edge.segments.DatasetReader``);
a swarm's thousands of devices each listed their folders every round.  A file added, renamed or
removed changes the folder's mtime, so an unchanged mtime means the same names.  One catch, as in
git's "racy" index entries: a change within the filesystem's timestamp tick after a listing leaves
the mtime as the listing saw it.  So a listing is kept only once the folder's mtime is older than
:data:`RACY_NS` when it is made.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

#: A listing is kept only if the folder's mtime was at least this old when it was made.
RACY_NS = 1_000_000_000


class FolderListing(Generic[T]):
    """``list_()`` of ``folder``, kept while the folder's inode and mtime stay; ``missing`` when it
    does not exist (never kept)."""

    def __init__(self, folder: Path, list_: Callable[[], T], missing: T) -> None:
        self.folder, self.list_, self.missing = folder, list_, missing
        self._kept: tuple[tuple[int, int], T] | None = None

    def get(self) -> T:
        try:
            st = os.stat(self.folder)
        except FileNotFoundError:
            self._kept = None
            return self.missing
        seen = (st.st_ino, st.st_mtime_ns)
        if self._kept is not None and self._kept[0] == seen:
            return self._kept[1]
        listed = self.list_()
        settled = time.time_ns() - st.st_mtime_ns > RACY_NS
        self._kept = (seen, listed) if settled else None
        return listed

    def forget(self) -> None:
        self._kept = None

"""Old module paths keep working, with a ``DeprecationWarning``, for one version after a move.

A package lists its moves once (``{"old.path": "new.path"}``) and calls :func:`keep_moved`
from its ``__init__``; importing an old path (or anything under it) then gives the module at
its new home -- the same object, so classes and registries stay one -- and warns, naming the
new path and the stable name in :mod:`ioft` where there is one.  No file is left at the old
path, and the import contracts see only the real imports.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers only for the moved paths it holds; every other import goes on as usual."""

    def __init__(self, moves: Mapping[str, str], removed_in: str) -> None:
        self.moves = dict(moves)
        self.removed_in = removed_in
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}  # new name -> its own spec

    def new_name(self, fullname: str) -> str | None:
        for old, new in self.moves.items():
            if fullname == old or fullname.startswith(old + "."):
                return new + fullname[len(old) :]
        return None

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        return None if self.new_name(fullname) is None else importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self.new_name(spec.name)
        if new is None:  # only find_spec's own specs come here
            raise ImportError(f"{spec.name} is not a moved module", name=spec.name)
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (or from `ioft`, the stable names): "
            f"the old path goes in version {self.removed_in}",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        # importlib sets the module's __spec__ to the old path's spec next: exec_module puts it back.
        self._specs.setdefault(new, module.__spec__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs[module.__name__]


def keep_moved(moves: Mapping[str, str], removed_in: str) -> None:
    """Let ``moves``' old paths import their new modules until ``removed_in`` (see the module docstring)."""
    # First in line: under a moved package the path finder would otherwise load a second copy
    # of a submodule (old.sub from the new package's folder) under the old name.
    sys.meta_path.insert(0, _MovedFinder(moves, removed_in))


def names_moved_out(module: str, moves: Mapping[str, str], removed_in: str) -> Callable[[str], object]:
    """A module's ``__getattr__`` for names that left it for other modules (``{name: new module}``):
    each still imports from ``module`` until ``removed_in``, from its new home, with a warning."""

    def moved_name(name: str) -> object:
        home = moves.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved to {home}; import it from there: the old path goes in version {removed_in}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return moved_name

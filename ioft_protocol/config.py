"""Declared configuration schemas, validated at start-up: TOML files to dataclasses.

``build(cls, mapping)`` checks a mapping against a dataclass schema and raises one
``ConfigError`` listing every failing field, so an operator fixes a config in one go.
Both sides read their TOML through it (``device.toml``, ``aggregator.toml``).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration that does not match its schema; ``errors`` lists each problem."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.errors = errors
        super().__init__(f"invalid configuration in {source}:\n  - " + "\n  - ".join(errors))


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; errors name the file and the line."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(str(path), ["file not found"]) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [f"not valid TOML: {exc}"]) from None


def _check(value: Any, tp: Any, where: str, errors: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        sub: list[str] = []
        for option in inner:
            sub = []
            out = _check(value, option, where, sub)
            if not sub:
                return out
        errors.extend(sub)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{where}: expected a table, got {type(value).__name__}")
            return value
        return _build(tp, value, where + ".", errors)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            errors.append(f"{where}: expected a list, got {type(value).__name__}")
            return value
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_check(v, item_tp, f"{where}[{i}]", errors) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            errors.append(f"{where}: expected a table, got {type(value).__name__}")
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # TOML integers are unbounded in tomllib
            errors.append(f"{where}: an integer of {len(str(abs(value)))} digits is out of range")
            return value
    if tp in (int, float, str, bool) and (
        not isinstance(value, tp) or (tp is not bool and isinstance(value, bool))
    ):
        errors.append(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def _build(cls: type, mapping: dict[str, Any], prefix: str, errors: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in sorted(set(mapping) - set(fields)):
        errors.append(f"{prefix}{key}: unknown field (valid: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        if name in mapping:
            kwargs[name] = _check(mapping[name], hints[name], prefix + name, errors)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append(f"{prefix}{name}: required")
    if any(e.startswith(prefix) for e in errors):
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        errors.append(f"{prefix.rstrip('.') or cls.__name__}: {exc}")
        return None


def build(cls: type, mapping: dict[str, Any], source: str = "configuration") -> Any:
    """An instance of dataclass ``cls`` from ``mapping``, or ``ConfigError`` listing every problem."""
    errors: list[str] = []
    out = _build(cls, mapping, "", errors)
    if errors:
        raise ConfigError(source, errors)
    return out

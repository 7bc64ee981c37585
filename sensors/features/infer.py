"""A feature schema inferred from a device's own recordings (a new sensor needs no code).

The default schema is the welder's (4 channels, 200 kHz, db4 level 12, >= 28,672 samples);
a 3-axis accelerometer + gyroscope at 10 Hz × 100 samples fits none of that.
:func:`infer_schema` keeps the default recipe (wavelet, mode, statistics, version) and takes
from the recordings what they determine:

* ``channels``: the recordings' channel names (``ch0``.. when they carry none), which must
  agree across recordings;
* ``sample_rate``: their common rate;
* ``level``: the deepest the *shortest* recording allows for the wavelet, PyWavelets'
  ``dwt_max_level`` (``level <= log2(n / (filter_length - 1))``, the rule behind
  :attr:`FeatureSchema.min_samples`), capped at the schema's 20;
* ``max_samples``: the default's, or the longest recording if that is longer.

:class:`SchemaChoice` says what was chosen: one log line (:meth:`SchemaChoice.line`, logged
by :func:`infer_schema`) and a dict for a device's status (:meth:`SchemaChoice.status`).

``edge-recorder schema --from FOLDER [--save schema.json]`` (or ``python -m
sensors.features.infer FILE|FOLDER...``) reads exported recordings (WAV, NPY or CSV with
their sidecars, :func:`sensors.welding.formats.read_weld_file`) at any rate, prints the
chosen schema's JSON and saves it for ``[sensors] schema = "schema.json"``; bad input gets
one line and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pywt

from sensors.features.dwt import FeatureInputError
from sensors.features.schema import DEFAULT_SCHEMA, FeatureSchema

log = logging.getLogger(__name__)

#: The deepest level :class:`FeatureSchema` accepts.
MAX_LEVEL = 20


def schema_facts(s: FeatureSchema) -> dict[str, Any]:
    """What a device's status says of the schema its rows follow (plain JSON types)."""
    return {
        "channels": list(s.channels),
        "sample_rate": s.sample_rate,
        "wavelet": s.wavelet,
        "level": s.level,
        "min_samples": s.min_samples,
        "n_features": s.n_features,
        "schema_hash": s.schema_hash(),
    }


@dataclass(frozen=True)
class SchemaChoice:
    """An inferred schema and what it was inferred from."""

    schema: FeatureSchema
    recordings: int
    shortest: int
    longest: int

    def line(self) -> str:
        """One line for the log: what was chosen, and why this level."""
        s = self.schema
        return (
            f"feature schema inferred from {self.recordings} recording(s) of {len(s.channels)} channel(s) × "
            f"{self.shortest}..{self.longest} samples at {s.sample_rate:g} Hz: channels {','.join(s.channels)}, "
            f"{s.wavelet} level {s.level} (the deepest {self.shortest} samples allow), {s.n_features} features "
            f"[sha256 {s.schema_hash()[:12]}]"
        )

    def status(self) -> dict[str, Any]:
        """The choice as plain JSON types, for a device's status file."""
        return {
            "inferred": True,
            **schema_facts(self.schema),
            "from_recordings": self.recordings,
            "shortest_recording": self.shortest,
        }


def deepest_level(n_samples: int, wavelet: str) -> int:
    """The deepest level whose every band is free of pure boundary effects for ``n_samples``."""
    return min(int(pywt.dwt_max_level(n_samples, pywt.Wavelet(wavelet).dec_len)), MAX_LEVEL)


def infer_schema(
    signals: Sequence[np.ndarray],
    sample_rates: Sequence[float] | float,
    channels: Sequence[Sequence[str] | None] | Sequence[str] | None = None,
    *,
    base: FeatureSchema = DEFAULT_SCHEMA,
) -> SchemaChoice:
    """The schema ``signals`` (each ``(n_channels, n_samples)``) fit, logged in one line.

    Parameters
    ----------
    signals
        The device's recordings.
    sample_rates
        One rate for all, or one per recording; they must agree.
    channels
        Channel names: one list for all, one per recording (``None`` entries: unnamed),
        or ``None`` (``ch0``, ``ch1``, ...).
    base
        The recipe kept (wavelet, mode, statistics, version).

    Raises
    ------
    FeatureInputError
        No recordings, recordings that disagree (channels, rate), or too short for any level.
    """
    if not signals:
        raise FeatureInputError("no recordings to infer a feature schema from; record at least one first")
    shapes = [np.shape(x) for x in signals]
    if any(len(sh) != 2 for sh in shapes):
        raise FeatureInputError(
            f"recordings must be 2-D (n_channels, n_samples); got shapes {sorted(set(shapes))}"
        )
    if len({sh[0] for sh in shapes}) != 1:
        raise FeatureInputError(
            f"recordings have different channel counts {sorted({sh[0] for sh in shapes})}; "
            "infer a schema from recordings of one sensor setup"
        )
    n_ch = shapes[0][0]
    rates = (
        [float(sample_rates)] * len(signals)
        if np.isscalar(sample_rates)
        else [float(r) for r in sample_rates]
    )  # type: ignore[arg-type]
    if len(rates) != len(signals) or not all(math.isfinite(r) and r > 0 for r in rates):
        raise FeatureInputError(f"need one positive sample rate per recording (got {rates})")
    if any(not math.isclose(r, rates[0], rel_tol=1e-9) for r in rates):
        raise FeatureInputError(
            f"recordings sampled at different rates {sorted(set(rates))} Hz; one schema needs one rate"
        )
    names = _names(channels, len(signals), n_ch)
    shortest, longest = min(sh[1] for sh in shapes), max(sh[1] for sh in shapes)
    level = deepest_level(shortest, base.wavelet)
    if level < 1:
        need = (base.filter_length - 1) * 2
        raise FeatureInputError(
            f"recordings of {shortest} samples are too short for one {base.wavelet} level (needs >= {need}); "
            "record longer windows"
        )
    schema = base.replace(
        channels=names,
        sample_rate=rates[0],
        level=level,
        max_samples=max(base.max_samples, longest),
    )
    choice = SchemaChoice(schema, len(signals), shortest, longest)
    log.info("%s", choice.line())
    return choice


def _names(channels: Any, n_rec: int, n_ch: int) -> tuple[str, ...]:
    """One channel list that every recording agrees on."""
    default = tuple(f"ch{i}" for i in range(n_ch))
    if channels is None:
        return default
    per = (
        [channels] * n_rec
        if all(isinstance(c, str) for c in channels)
        else [default if c is None else c for c in channels]
    )
    lists = {tuple(c) for c in per}
    if len(lists) != 1:
        raise FeatureInputError(f"recordings name their channels differently: {sorted(lists)}")
    names = lists.pop()
    if len(names) != n_ch:
        raise FeatureInputError(f"{len(names)} channel name(s) {list(names)} for {n_ch} channel row(s)")
    return names


def recording_files(paths: Sequence[str | Path]) -> list[Path]:
    """The recordings named: files as given, folders as their WAV/NPY/CSV files (sorted, not recursive)."""
    from sensors.welding.formats import WELD_SUFFIXES

    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in WELD_SUFFIXES)
            if not found:
                raise FeatureInputError(
                    f"{p}: no recordings ({', '.join(WELD_SUFFIXES)}) to infer a feature schema from"
                )
            out += found
        elif p.exists():
            out.append(p)
        else:
            raise FeatureInputError(f"{p}: no such file or folder")
    return out


def infer_from_files(paths: Sequence[str | Path]) -> SchemaChoice:
    """:func:`infer_schema` on exported recordings (files, or folders of them), at whatever rate.

    Raises
    ------
    FeatureInputError
        As :func:`infer_schema`, or a path that is missing or holds no recordings.
    WeldDataError, OSError
        A recording that cannot be read (the message names it).
    """
    from sensors.welding.formats import read_weld_file

    # Any positive rate: the schema takes the recordings' rate, the reader's weld minimum
    # (200 kHz) is for the default schema only.
    recs = [read_weld_file(f, min_sample_rate=1e-9) for f in recording_files(paths)]
    return infer_schema(
        [r.data for r in recs], [r.sample_rate for r in recs], [list(r.channels) for r in recs]
    )


def load_schema_file(path: str | Path) -> FeatureSchema:
    """A schema saved by ``--save`` (its canonical JSON), checked; one-line errors.

    Raises
    ------
    FeatureInputError
        Unreadable, not JSON, or not a consistent feature schema.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FeatureInputError(
            f"feature schema file {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    try:
        return FeatureSchema.from_json(text)
    except (ValueError, TypeError) as exc:  # JSONDecodeError and SchemaMismatchError are ValueErrors
        raise FeatureInputError(
            f"feature schema file {path} is not a saved feature schema ({exc}); "
            "make one with: edge-recorder schema --from FOLDER --save FILE"
        ) from None


def save_schema_file(schema: FeatureSchema, path: str | Path) -> None:
    """Write ``schema``'s canonical JSON (what :func:`load_schema_file` reads, hashed as is)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(schema.to_json() + "\n", encoding="ascii")
    os.replace(tmp, path)  # a reader never sees half a schema


#: Where ``schema = "infer"`` keeps the schema it inferred, in the recorder's state folder.
INFERRED_FILE = "feature-schema.json"


def configured_schema(
    setting: str | None, folder: str | Path, state_dir: str | Path
) -> tuple[FeatureSchema, dict[str, Any]]:
    """The schema a recorder's ``[sensors] schema`` names, and what its status says about it.

    Parameters
    ----------
    setting
        ``None`` (the default schema), ``"infer"`` (from the recordings in ``folder`` the first
        time, then the copy kept in ``state_dir``: the dataset's schema must not drift as longer
        or shorter recordings arrive), or a schema file's path.
    folder
        The recordings to infer from.
    state_dir
        Where an inferred schema is kept.

    Raises
    ------
    FeatureInputError
        A schema that cannot be read or inferred (one line naming what to fix).
    WeldDataError, OSError
        A recording to infer from that cannot be read.
    """
    if setting is None:
        s = DEFAULT_SCHEMA
        return s, {"source": "default", "schema_hash": s.schema_hash(), "n_features": s.n_features}
    if setting == "infer":
        kept = Path(state_dir) / INFERRED_FILE
        if kept.exists():
            s = load_schema_file(kept)
            info = {"source": "inferred", "file": str(kept), "inferred": True}
        else:
            choice = infer_from_files([folder])
            Path(state_dir).mkdir(parents=True, exist_ok=True)
            save_schema_file(choice.schema, kept)
            s, info = choice.schema, {"source": "inferred", "file": str(kept), **choice.status()}
    else:
        s = load_schema_file(setting)
        info = {"source": "file", "file": str(setting), "inferred": False}
    return s, {**schema_facts(s), **info}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``edge-recorder schema`` and ``python -m sensors.features.infer``."""
    ap.add_argument(
        "--from",
        dest="paths",
        nargs="+",
        metavar="PATH",
        required=True,
        help="recordings (WAV, NPY or CSV with their sidecars), or folders of them",
    )
    ap.add_argument(
        "--save", metavar="FILE", help="write the schema's JSON here, for [sensors] schema = FILE"
    )


def run(args: argparse.Namespace) -> int:
    """Infer, show (stderr: one line; stdout: the JSON) and optionally save; bad input: one line, 2."""
    from sensors.welding.recording import WeldDataError

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        choice = infer_from_files(args.paths)
        if args.save:
            save_schema_file(choice.schema, args.save)
    except (OSError, WeldDataError) as exc:  # FeatureInputError is a WeldDataError
        print(f"cannot infer a feature schema: {exc}", file=sys.stderr)
        return 2
    print(choice.schema.to_json())
    if args.save:
        print(
            f"saved to {args.save}: set [sensors] schema = {str(args.save)!r} on the device and "
            f"feature_schema = {choice.schema.schema_hash()!r} (or the file) in the aggregator's [[task]]",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sensors.features.infer", description=__doc__.split("\n")[0])
    # Files go positionally here, or after --from as `edge-recorder schema` takes them: one habit works in both.
    ap.add_argument("files", nargs="*", help="recordings (WAV, NPY or CSV, with their sidecars) or folders")
    ap.add_argument("--from", dest="paths", nargs="+", metavar="PATH", default=[], help="as the files")
    ap.add_argument("--save", metavar="FILE", help="write the schema's JSON here")
    args = ap.parse_args(argv)
    args.paths = [*args.files, *args.paths]
    if not args.paths:
        ap.error("name recordings or a folder of them")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

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

``python -m sensors.features.infer FILE...`` reads exported recordings (WAV, NPY or CSV
with their sidecars, :func:`sensors.welding.formats.read_weld_file`) and prints the
chosen schema's JSON; bad input gets one line and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pywt

from sensors.features.dwt import FeatureInputError
from sensors.features.schema import DEFAULT_SCHEMA, FeatureSchema

log = logging.getLogger(__name__)

#: The deepest level :class:`FeatureSchema` accepts.
MAX_LEVEL = 20


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
        s = self.schema
        return {
            "inferred": True,
            "channels": list(s.channels),
            "sample_rate": s.sample_rate,
            "wavelet": s.wavelet,
            "level": s.level,
            "min_samples": s.min_samples,
            "n_features": s.n_features,
            "schema_hash": s.schema_hash(),
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


def main(argv: Sequence[str] | None = None) -> int:
    from sensors.welding.formats import read_weld_file
    from sensors.welding.recording import WeldDataError

    ap = argparse.ArgumentParser(prog="python -m sensors.features.infer", description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="recordings (WAV, NPY or CSV, with their sidecars)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        recs = [read_weld_file(f, min_sample_rate=1e-9) for f in args.files]
        choice = infer_schema(
            [r.data for r in recs], [r.sample_rate for r in recs], [list(r.channels) for r in recs]
        )
    except (OSError, WeldDataError) as exc:  # FeatureInputError is a WeldDataError
        print(f"cannot infer a feature schema: {exc}", file=sys.stderr)
        return 2
    print(choice.schema.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The versioned description of a DWT feature vector, and its hash that models carry.

A model trained on feature vectors of one recipe is meaningless on vectors of another
(a different wavelet, level, channel order or sample rate silently permutes or
rescales its inputs).  Every model and ONNX export therefore carries the sha256 of
the canonical JSON of the :class:`FeatureSchema` it was trained on, and a device
refuses to load a model whose hash differs from the schema it extracts
(:func:`check_schema`, :func:`check_model_metadata`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pywt

from sensors.welding.recording import WELD_CHANNELS

SCHEMA_NAME = "ioft.weld.dwt"
#: Per-band statistics, in feature order (definitions in the module docstring of
#: :mod:`sensors.features.dwt` and in ``sensors/features/README.md``).
STATS: tuple[str, ...] = (
    "mean",
    "std",
    "mean_abs",
    "max_abs",
    "log_energy",
    "energy_frac",
    "crest",
    "skewness",
    "kurtosis",
    "energy_spread",
    "zero_cross_rate",
    "time_centroid",
)
#: Keys under which models, manifests and ONNX ``metadata_props`` carry the schema.
SCHEMA_HASH_KEY = "ioft.feature_schema.sha256"
SCHEMA_JSON_KEY = "ioft.feature_schema.json"
_MODES = (
    "zero",
    "constant",
    "symmetric",
    "periodic",
    "smooth",
    "periodization",
    "reflect",
    "antisymmetric",
    "antireflect",
)


class SchemaMismatchError(ValueError):
    """A model was built for a different feature schema than the one this device extracts."""


@dataclass(frozen=True)
class FeatureSchema:
    """What a DWT feature vector means.

    Parameters
    ----------
    version
        Recipe version: bump it whenever a statistic's definition changes.
    wavelet
        PyWavelets discrete wavelet name.
    mode
        PyWavelets signal extension mode at the boundaries.
    level
        Decomposition levels; there are ``level + 1`` bands ``A<level>, D<level>..D1``.
    channels
        Channel names in feature order.
    sample_rate
        The rate every input must have (band edges in Hz depend on it).
    max_samples
        Longest accepted weld (bounds memory on the device).
    stats
        Statistic names, in feature order.
    """

    version: int = 1
    wavelet: str = "db4"
    mode: str = "symmetric"
    level: int = 12
    channels: tuple[str, ...] = WELD_CHANNELS
    sample_rate: float = 200_000.0
    max_samples: int = 4_000_000
    stats: tuple[str, ...] = STATS

    def __post_init__(self) -> None:
        object.__setattr__(self, "channels", tuple(self.channels))
        object.__setattr__(self, "stats", tuple(self.stats))
        object.__setattr__(self, "sample_rate", float(self.sample_rate))
        errors = []
        if not isinstance(self.version, int) or self.version < 1:
            errors.append(f"version must be a positive int (got {self.version!r})")
        if self.wavelet not in pywt.wavelist(kind="discrete"):
            errors.append(
                f"wavelet {self.wavelet!r} is not a PyWavelets discrete wavelet (e.g. db4, sym5, coif3)"
            )
        if self.mode not in _MODES:
            errors.append(f"mode {self.mode!r} not in {_MODES}")
        if not isinstance(self.level, int) or not 1 <= self.level <= 20:
            errors.append(f"level must be an int in 1..20 (got {self.level!r})")
        if not self.channels or len(set(self.channels)) != len(self.channels):
            errors.append(f"channels must be non-empty and unique (got {self.channels!r})")
        if not (math.isfinite(self.sample_rate) and self.sample_rate > 0):
            errors.append(f"sample_rate must be positive (got {self.sample_rate})")
        unknown = [s for s in self.stats if s not in STATS]
        if unknown or not self.stats or len(set(self.stats)) != len(self.stats):
            errors.append(f"stats must be unique names from {STATS} (bad: {unknown or self.stats})")
        if errors:
            raise ValueError("invalid FeatureSchema: " + "; ".join(errors))
        if self.max_samples < self.min_samples:
            raise ValueError(
                f"invalid FeatureSchema: max_samples {self.max_samples} < min_samples {self.min_samples}"
            )

    @property
    def filter_length(self) -> int:
        """Length of the wavelet's decomposition filters."""
        return int(pywt.Wavelet(self.wavelet).dec_len)

    @property
    def min_samples(self) -> int:
        """Shortest input for which every level is free of pure boundary effects.

        PyWavelets' ``dwt_max_level``: ``level <= log2(n / (filter_length - 1))``.
        """
        return (self.filter_length - 1) * 2**self.level

    @property
    def bands(self) -> tuple[str, ...]:
        """Band names in PyWavelets ``wavedec`` order: ``A<level>, D<level>, ..., D1``."""
        return (f"A{self.level}", *(f"D{k}" for k in range(self.level, 0, -1)))

    def band_edges_hz(self) -> dict[str, tuple[float, float]]:
        """Nominal frequency range of each band (ideal half-band split)."""
        nyq = self.sample_rate / 2
        edges = {f"A{self.level}": (0.0, nyq / 2**self.level)}
        for k in range(self.level, 0, -1):
            edges[f"D{k}"] = (nyq / 2**k, nyq / 2 ** (k - 1))
        return edges

    @property
    def n_features(self) -> int:
        """Length of the feature vector."""
        return len(self.channels) * len(self.bands) * len(self.stats)

    def feature_names(self) -> list[str]:
        """``"<channel>.<band>.<stat>"`` for every feature, in vector order."""
        return [f"{c}.{b}.{s}" for c in self.channels for b in self.bands for s in self.stats]

    def to_dict(self) -> dict[str, Any]:
        """Everything that determines the feature values, as plain JSON types."""
        return {
            "name": SCHEMA_NAME,
            "version": self.version,
            "wavelet": self.wavelet,
            "mode": self.mode,
            "level": self.level,
            "bands": list(self.bands),
            "stats": list(self.stats),
            "channels": list(self.channels),
            "sample_rate": self.sample_rate,
            "min_samples": self.min_samples,
            "max_samples": self.max_samples,
            "dtype": "float64",
            "layout": "channel-major: index = (channel * n_bands + band) * n_stats + stat",
            "n_features": self.n_features,
        }

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no spaces, ASCII only."""
        return json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )

    def schema_hash(self) -> str:
        """sha256 (hex) of :meth:`to_json`."""
        return hashlib.sha256(self.to_json().encode("ascii")).hexdigest()

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> FeatureSchema:
        """Rebuild a schema from :meth:`to_dict` output (derived fields are checked, not trusted)."""
        if obj.get("name") != SCHEMA_NAME:
            raise SchemaMismatchError(f"not a {SCHEMA_NAME} schema: name={obj.get('name')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        schema = cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in obj.items() if k in fields})
        again = schema.to_dict()
        derived = ("bands", "min_samples", "n_features", "dtype", "layout")
        differ = sorted(k for k in derived if k in obj and _canon(obj[k]) != _canon(again[k]))
        if differ:
            raise SchemaMismatchError(
                f"schema fields {differ} are inconsistent with the recipe they describe"
            )
        return schema

    @classmethod
    def from_json(cls, text: str) -> FeatureSchema:
        """Rebuild a schema from :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> FeatureSchema:
        """A copy with some parameters changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line for logs and error messages."""
        return (
            f"{SCHEMA_NAME} v{self.version}: {self.wavelet}/{self.mode} level {self.level}, "
            f"channels {','.join(self.channels)}, {self.sample_rate:g} Hz, {self.n_features} features "
            f"[sha256 {self.schema_hash()[:12]}]"
        )


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


#: The recipe FTL-TP's 624 features map to: 4 channels x 13 bands x 12 statistics.
DEFAULT_SCHEMA = FeatureSchema()


def schema_hash(schema: FeatureSchema = DEFAULT_SCHEMA) -> str:
    """sha256 hex of a schema's canonical JSON (the default schema's unless given)."""
    return schema.schema_hash()


def check_schema(
    model_schema: str | Mapping[str, Any] | FeatureSchema, device_schema: FeatureSchema = DEFAULT_SCHEMA
) -> None:
    """Refuse a model built for another feature schema.

    Parameters
    ----------
    model_schema
        What the model carries: the schema hash, the schema's dict, or the schema.
    device_schema
        The schema this device extracts.

    Raises
    ------
    SchemaMismatchError
        Naming both hashes and, when the model carries the full schema, each differing field.
    """
    want = device_schema.schema_hash()
    if isinstance(model_schema, str):
        got, diffs = model_schema.strip().lower(), []
    else:
        other = (
            model_schema if isinstance(model_schema, FeatureSchema) else FeatureSchema.from_dict(model_schema)
        )
        got = other.schema_hash()
        mine, theirs = device_schema.to_dict(), other.to_dict()
        diffs = [
            f"{k}: model {theirs[k]!r} vs device {mine[k]!r}" for k in sorted(mine) if mine[k] != theirs[k]
        ]
    if got != want:
        detail = ("; differing fields: " + "; ".join(diffs)) if diffs else ""
        raise SchemaMismatchError(
            f"model was built for feature schema sha256 {got[:16]}..., but this device extracts "
            f"{device_schema.describe()}{detail}. Use a model exported for this schema, or configure "
            "the device's feature extraction to match the model"
        )


def schema_metadata(schema: FeatureSchema = DEFAULT_SCHEMA) -> dict[str, str]:
    """String metadata for a model manifest or ONNX ``metadata_props``."""
    return {SCHEMA_HASH_KEY: schema.schema_hash(), SCHEMA_JSON_KEY: schema.to_json()}


def check_model_metadata(metadata: Mapping[str, str], schema: FeatureSchema = DEFAULT_SCHEMA) -> None:
    """Check a model's metadata (e.g. onnxruntime's ``custom_metadata_map``) against ``schema``.

    Raises
    ------
    SchemaMismatchError
        If the metadata carries no schema hash, if its JSON and hash disagree, or if it
        was built for another schema.
    """
    if SCHEMA_HASH_KEY not in metadata:
        raise SchemaMismatchError(
            f"model metadata has no {SCHEMA_HASH_KEY!r}; refusing a model of unknown feature schema "
            f"(export it with sensors.features.schema_metadata())"
        )
    if SCHEMA_JSON_KEY in metadata:
        carried = FeatureSchema.from_json(metadata[SCHEMA_JSON_KEY])
        if carried.schema_hash() != metadata[SCHEMA_HASH_KEY].strip().lower():
            raise SchemaMismatchError("model metadata's schema JSON does not match its schema hash")
        check_schema(carried, schema)
    else:
        check_schema(metadata[SCHEMA_HASH_KEY], schema)

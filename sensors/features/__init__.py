"""Feature extraction: DWT band statistics of welds, with a versioned, hashed schema.

The device computes rows with :func:`extract_features` / :func:`extract_many` and refuses
models whose schema hash differs (:func:`check_schema`, :func:`check_model_metadata`).
"""

from sensors.features.dwt import FeatureInputError, extract_batch, extract_features, extract_many
from sensors.features.schema import (
    DEFAULT_SCHEMA,
    SCHEMA_HASH_KEY,
    SCHEMA_JSON_KEY,
    STATS,
    FeatureSchema,
    SchemaMismatchError,
    check_model_metadata,
    check_schema,
    schema_hash,
    schema_metadata,
)

__all__ = [
    "DEFAULT_SCHEMA",
    "SCHEMA_HASH_KEY",
    "SCHEMA_JSON_KEY",
    "STATS",
    "FeatureInputError",
    "FeatureSchema",
    "SchemaMismatchError",
    "check_model_metadata",
    "check_schema",
    "extract_batch",
    "extract_features",
    "extract_many",
    "schema_hash",
    "schema_metadata",
]

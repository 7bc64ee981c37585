"""Simulated FTL-TP domain groups (§3.2, Table 1): every weld of group M, S or T, as recordings or features.

The welds themselves come from :func:`sensors.sim.welder.simulate_weld`; this module lays out which
welds a group holds, seeds each one, and extracts their features in batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np

from sensors.features.dwt import extract_batch
from sensors.features.schema import DEFAULT_SCHEMA, FeatureSchema
from sensors.sim.welder import (
    GROUP_M_CLASSES,
    GROUP_M_DOMAINS,
    GROUP_S_CLASSES,
    GROUP_S_DOMAINS,
    GROUP_S_MATERIAL,
    GROUP_S_TIME,
    SURFACES,
    WeldCondition,
    simulate_weld,
)
from sensors.welding.recording import WeldRecording


@dataclass(frozen=True)
class DomainGroupData:
    """A simulated FTL-TP domain group, as features.

    Attributes
    ----------
    group
        ``"M"``, ``"S"`` or ``"T"``.
    X
        Features, shape ``(n, schema.n_features)``.
    y
        The group's task labels (tool class for M and S, surface for T), ints into ``classes``.
    domain
        Domain index per weld, into ``domains``.
    tool, surface
        Tool class (into ``tool_classes``) and surface (into :data:`SURFACES`) per weld.
    """

    group: str
    X: np.ndarray
    y: np.ndarray
    domain: np.ndarray
    tool: np.ndarray
    surface: np.ndarray
    classes: tuple[str, ...]
    domains: tuple[str, ...]
    tool_classes: tuple[str, ...]
    schema: FeatureSchema
    conditions: tuple[WeldCondition, ...] = field(repr=False, default=())

    @property
    def schema_hash(self) -> str:
        """Hash of the feature schema the rows were extracted with."""
        return self.schema.schema_hash()


def group_conditions(
    group: str, n_per_domain: int | None = None
) -> list[tuple[WeldCondition, int, int, int]]:
    """``(condition, domain, tool_class, surface)`` for every weld of a domain group, in order."""
    group = group.upper()
    if group == "M":
        n = 200 if n_per_domain is None else n_per_domain
        rows = []
        for d, (material, weld_time) in enumerate(GROUP_M_DOMAINS):
            for i in range(n):
                k = i % len(GROUP_M_CLASSES)
                horn, anvil = GROUP_M_CLASSES[k][1]
                rows.append((WeldCondition(horn, anvil, "clean", material, weld_time), d, k, 0))
        return rows
    if group in ("S", "T"):
        n = 90 if n_per_domain is None else n_per_domain
        rows = []
        for d, surface in enumerate(GROUP_S_DOMAINS):
            for i in range(n):
                k = i % len(GROUP_S_CLASSES)
                horn, anvil = GROUP_S_CLASSES[k][1]
                rows.append((WeldCondition(horn, anvil, surface, GROUP_S_MATERIAL, GROUP_S_TIME), d, k, d))
        return rows
    raise ValueError(f"unknown domain group {group!r}; use 'M', 'S' or 'T' (FTL-TP Table 1)")


def simulate_group_recordings(
    group: str,
    n_per_domain: int | None = None,
    *,
    seed: int = 0,
    sample_rate: float = 200_000.0,
    time_scale: float = 1.0,
) -> Iterator[tuple[WeldRecording, WeldCondition, int, int, int]]:
    """Yield ``(recording, condition, domain, tool_class, surface)`` for a domain group.

    Weld ``i`` draws from ``SeedSequence(seed).spawn(...)[i]``, so S and T with the same
    seed are the same welds, and the welds do not depend on how many are consumed.
    """
    rows = group_conditions("S" if group.upper() == "T" else group, n_per_domain)
    seeds = np.random.SeedSequence(seed).spawn(len(rows))
    start = datetime(2024, 1, 1, 6, 0, tzinfo=UTC)
    for i, ((cond, d, k, s), ss) in enumerate(zip(rows, seeds, strict=True)):
        rec = simulate_weld(
            cond,
            np.random.default_rng(ss),
            sample_rate=sample_rate,
            time_scale=time_scale,
            weld_id=f"sim-{group.upper()}-{i:05d}",
            started_at=start + timedelta(seconds=20 * i),
        )
        yield rec, cond, d, k, s


def simulate_domain_group(
    group: str,
    n_per_domain: int | None = None,
    *,
    seed: int = 0,
    sample_rate: float = 200_000.0,
    time_scale: float = 1.0,
    schema: FeatureSchema | None = None,
) -> DomainGroupData:
    """Features and labels of a whole FTL-TP domain group.

    Parameters
    ----------
    group
        ``"M"`` (4 material domains, 200 welds each by default, tool classes TC1-TC4),
        ``"S"`` (3 surface domains, 90 each, tool classes New/Worn/DMGD) or ``"T"``
        (the S welds, classes = surface, domains = tool condition).
    n_per_domain
        Welds per domain (classes are balanced round-robin within a domain).
    seed
        Seeds every weld (see :func:`simulate_group_recordings`).
    sample_rate, time_scale
        Lower either for speed (see :mod:`sensors.sim.welder`).
    schema
        Feature recipe; default: :data:`DEFAULT_SCHEMA` at ``sample_rate``.

    Returns
    -------
    DomainGroupData
    """
    group = group.upper()
    schema = schema or DEFAULT_SCHEMA.replace(sample_rate=float(sample_rate))
    recordings = simulate_group_recordings(
        group, n_per_domain, seed=seed, sample_rate=sample_rate, time_scale=time_scale
    )
    X, meta = _features(recordings, schema, sample_rate)
    domain, tool, surface = (np.array([m[i] for m in meta], dtype=np.int64) for i in (1, 2, 3))
    tool_classes = tuple(name for name, _ in (GROUP_M_CLASSES if group == "M" else GROUP_S_CLASSES))
    conditions = tuple(m[0] for m in meta)
    if group == "T":  # the S welds labelled by surface; the domains are the tool conditions
        return DomainGroupData(
            "T", X, surface, tool, tool, surface, SURFACES, tool_classes, tool_classes, schema, conditions
        )
    domains = tuple(m for m, _ in GROUP_M_DOMAINS) if group == "M" else GROUP_S_DOMAINS
    return DomainGroupData(
        group, X, tool, domain, tool, surface, tool_classes, domains, tool_classes, schema, conditions
    )


def _features(
    recordings: Iterator[tuple[WeldRecording, WeldCondition, int, int, int]],
    schema: FeatureSchema,
    sample_rate: float,
) -> tuple[np.ndarray, list[tuple[WeldCondition, int, int, int]]]:
    """The recordings' feature rows, extracted eight welds of one length at a time, and their labels."""
    rows: list[np.ndarray] = []
    meta: list[tuple[WeldCondition, int, int, int]] = []
    pending: list[WeldRecording] = []

    def flush() -> None:
        if pending:
            stack = np.stack([r.select(schema.channels) for r in pending])
            rows.append(extract_batch(stack, schema, sample_rate=sample_rate))
            pending.clear()

    for rec, cond, d, k, s in recordings:
        if pending and pending[0].n_samples != rec.n_samples:
            flush()
        pending.append(rec)
        meta.append((cond, d, k, s))
        if len(pending) >= 8:
            flush()
    flush()
    return (np.concatenate(rows) if rows else np.empty((0, schema.n_features))), meta


def nearest_class_mean_accuracy(
    X_train: np.ndarray, y_train: np.ndarray, X_test: np.ndarray, y_test: np.ndarray
) -> float:
    """Accuracy of a nearest-class-mean classifier on features standardised by the training set.

    A deliberately simple probe (NumPy only) for separability and domain shift.
    """
    mu, sd = X_train.mean(axis=0), X_train.std(axis=0)
    sd = np.where(sd > 1e-12, sd, 1.0)
    Z_train, Z_test = (X_train - mu) / sd, (X_test - mu) / sd
    labels = np.unique(y_train)
    means = np.stack([Z_train[y_train == c].mean(axis=0) for c in labels])
    dist = ((Z_test[:, None, :] - means[None, :, :]) ** 2).sum(axis=-1)
    return float((labels[np.argmin(dist, axis=1)] == y_test).mean())

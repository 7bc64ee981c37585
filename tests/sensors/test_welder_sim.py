"""The welder simulator: labelled FTL-TP domain groups whose classes separate and whose domains shift."""

from __future__ import annotations

import numpy as np
import pytest

from sensors.features import DEFAULT_SCHEMA, FeatureSchema
from sensors.sim.weld_groups import nearest_class_mean_accuracy, simulate_domain_group
from sensors.sim.welder import SURFACES, WeldCondition, simulate_weld

#: Short welds (time_scale 0.1 -> 50-100 ms) need a shallower decomposition: 10 bands.
FAST = {"time_scale": 0.1, "schema": FeatureSchema(level=9)}


def within_and_cross(data, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-domain held-out accuracy, and the train-on-a/test-on-b matrix (a != b)."""
    nd = len(data.domains)
    within, cross = np.zeros(nd), np.full((nd, nd), np.nan)
    for a in range(nd):
        idx = np.random.default_rng(seed + a).permutation(np.flatnonzero(data.domain == a))
        half = len(idx) // 2
        within[a] = nearest_class_mean_accuracy(
            data.X[idx[:half]], data.y[idx[:half]], data.X[idx[half:]], data.y[idx[half:]]
        )
        for b in range(nd):
            if a != b:
                ia, ib = data.domain == a, data.domain == b
                cross[a, b] = nearest_class_mean_accuracy(data.X[ia], data.y[ia], data.X[ib], data.y[ib])
    return within, cross


def test_group_m_classes_separate_within_a_material_and_shift_across_materials():
    data = simulate_domain_group("M", 40, seed=3, **FAST)
    within, cross = within_and_cross(data)
    chance = 1 / len(data.classes)
    assert within.min() >= 0.6 and within.mean() >= 0.8, within  # chance is 0.25
    assert np.nanmean(cross) <= within.mean() - 0.25, (within, cross)  # the domain shift is real
    assert np.nanmin(cross) <= chance + 0.1


def test_group_t_surfaces_separate_within_a_tool_state_and_shift_across_tool_states():
    data = simulate_domain_group("T", 30, seed=4, **FAST)
    assert data.classes == SURFACES and data.domains == ("New", "Worn", "DMGD")
    within, cross = within_and_cross(data)
    assert within.mean() >= 0.6, within  # chance is 1/3; 5 training welds per class
    assert np.nanmean(cross) <= within.mean() - 0.15, (within, cross)


def test_group_shapes_labels_and_default_schema():
    data = simulate_domain_group("M", 4, seed=0, time_scale=0.3)
    assert data.X.shape == (16, 624) and np.isfinite(data.X).all()
    assert data.schema_hash == DEFAULT_SCHEMA.schema_hash()
    assert data.domains == ("Al-Cu", "Cu-Cu", "Cu-Al", "Al-Al") and data.classes == (
        "TC1",
        "TC2",
        "TC3",
        "TC4",
    )
    np.testing.assert_array_equal(data.domain, np.repeat(np.arange(4), 4))
    np.testing.assert_array_equal(data.y, np.tile(np.arange(4), 4))
    times = {c.material: c.weld_time for c in data.conditions}
    assert times == {"Al-Cu": 0.5, "Cu-Cu": 0.9, "Cu-Al": 0.5, "Al-Al": 0.9}  # FTL-TP Table 1a


def test_s_and_t_are_the_same_welds_with_swapped_roles_and_seeds_are_reproducible():
    s = simulate_domain_group("S", 3, seed=11, **FAST)
    t = simulate_domain_group("T", 3, seed=11, **FAST)
    np.testing.assert_array_equal(s.X, t.X)
    np.testing.assert_array_equal(s.y, t.domain)
    np.testing.assert_array_equal(s.domain, t.y)
    assert s.classes == ("New", "Worn", "DMGD") and s.domains == SURFACES
    again = simulate_domain_group("S", 3, seed=11, **FAST)
    np.testing.assert_array_equal(s.X, again.X)
    assert not np.array_equal(s.X, simulate_domain_group("S", 3, seed=12, **FAST).X)


def test_single_weld_physics_is_where_the_docstring_says():
    rng = np.random.default_rng(0)
    rec = simulate_weld(WeldCondition("new", "new", "clean", "Cu-Cu", 0.5), rng, time_scale=0.3)
    assert rec.channels == ("power", "lvdt", "ae", "mic") and rec.sample_rate == 200_000
    assert rec.n_samples == 30_000
    spectrum = np.abs(np.fft.rfft(rec.channel("mic")))
    freqs = np.fft.rfftfreq(rec.n_samples, 1 / rec.sample_rate)
    assert abs(freqs[np.argmax(spectrum)] - 20_000) < 100  # the ultrasonic carrier
    power, lvdt = rec.channel("power"), rec.channel("lvdt")
    assert power[:300].mean() < 0.5 * power[10_000:20_000].mean()  # ramp-up
    assert lvdt[-1000:].mean() > 5 * max(lvdt[:500].mean(), 1e-4)  # indentation grows
    worn = simulate_weld(
        WeldCondition("worn", "worn", "clean", "Cu-Cu", 0.5), np.random.default_rng(0), time_scale=0.3
    )
    assert worn.channel("lvdt")[-1000:].mean() < lvdt[-1000:].mean()  # a worn knurl indents less


def test_lower_sample_rate_and_bad_conditions():
    data = simulate_domain_group("S", 1, seed=0, sample_rate=100_000, time_scale=0.3)
    assert data.schema.sample_rate == 100_000 and data.X.shape == (3, 624)
    with pytest.raises(ValueError, match="horn='blunt' not in"):
        WeldCondition(horn="blunt")
    with pytest.raises(ValueError, match="unknown domain group 'X'"):
        simulate_domain_group("X")


def test_the_wear_signature_moves_between_dwt_bands_with_material_and_surface():
    """Knurl chatter rings at the contact resonance: 6-12 kHz (d4) under an aluminium top sheet or
    a cutting-fluid film, up beside the carrier (d3) under sanded copper, where d4 no longer shows it."""
    from benchmarks.welder_bands import band_energy

    def d4_ratio(material: str, surface: str) -> float:
        worn = np.mean([band_energy("worn", material, surface, s) for s in range(3)], axis=0)
        new = np.mean([band_energy("new", material, surface, s) for s in range(3)], axis=0)
        return float(worn[3] / new[3])

    assert d4_ratio("Al-Al", "clean") > 2.5
    assert d4_ratio("Cu-Cu", "contaminated") > 2.5
    assert d4_ratio("Cu-Cu", "polished") < 1.5

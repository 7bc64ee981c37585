"""benchmarks.field_accuracy, small: every arm scores every round, the personalized printer models learn
and beat the printers trained alone, and every welder's wearing tool is alerted on after it starts to
wear, never before (orderings, not times)."""

from __future__ import annotations

import math

import pytest

from benchmarks import field_accuracy


@pytest.mark.slow
def test_field_accuracy_orderings():
    kinds, alerts = field_accuracy.run(n_printers=3, n_welders=2, rounds=6, field_welds=8)
    for kind in kinds:
        for arm in field_accuracy.ARMS:
            assert len(kind.per_round[arm]) == 6 and all(math.isfinite(v) for v in kind.per_round[arm])
    printers = kinds[0].per_round
    assert printers["personalized"][-1] < printers["personalized"][0]
    assert field_accuracy.at_least_as_good(kinds[0])["alone"]
    assert all(w is not None and w > 0 for w in alerts["personalized"]["welds"])
    assert sum(alerts["personalized"]["false"]) == 0


@pytest.mark.slow
def test_each_round_scores_the_model_each_device_serves():
    """The score of a round is that of the model ``edge-trainer`` swaps in after it: the global the
    device trained from with its own parts after the round -- the pair the device itself scores on
    the same rows (its ``test_accuracy``), not the global aggregated at the round's end."""
    kind = field_accuracy.welders(2, rounds=3, field_welds=8)
    sims = field_accuracy.run_kind(kind)
    for arm, sim in sims.items():
        for r, rec in enumerate(sim.records):
            for device in kind.clients:
                assert kind.per_device[arm][device][r] == pytest.approx(rec.metrics[device]["test_accuracy"])


def test_a_judge_that_knows_the_field_one_round_late_misses_a_best_that_changes_every_round():
    """``known_late`` serves round r the candidate best on the field in round r - 1: a machine whose
    best candidate alternates misses, one whose best stays put does not (errors: lower is better)."""
    steady = {"personal": [9.0] * 6, "global": [5.0] * 6, "alone": [8.0] * 6}
    swapping = {
        "personal": [9.0] * 6,
        "global": [5.0, 8.0, 5.0, 8.0, 5.0, 8.0],
        "alone": [8.0, 5.0, 8.0, 5.0, 8.0, 5.0],
    }
    kind = field_accuracy.Kind("printer", "error", {}, {"steady": None, "swapping": None})
    kind.candidates = {
        c: {d: [(f, 0.0) for f in figures[c]] for d, figures in (("steady", steady), ("swapping", swapping))}
        for c in field_accuracy.ORDER
    }
    assert field_accuracy.known_late(kind) == "1 of 2"


@pytest.mark.parametrize(
    "make", [field_accuracy.printers, field_accuracy.welders], ids=["printers", "welders"]
)
def test_the_served_figure_is_the_devices_own_choice_among_its_candidates_and_they_are_the_arms_models(make):
    """What serves is ``edge-trainer``'s serving (``benchmarks.served_device``), and the candidates the
    study scores are the ones the device judged: where it serves this round's model, its field figure
    is the figure of the candidate it names; and the device's personal candidate is the personalized
    arm's model (its field figure, round by round)."""
    kind = make(4, 4) if make is field_accuracy.printers else make(4, 4, 8)
    field_accuracy.run_kind(kind)
    names = {c[0].upper(): c for c in field_accuracy.ORDER}
    for device in kind.clients:
        served = kind.served[device]
        assert len(served) == 4
        for r, (name, figure, kept) in enumerate(served):
            if not kept:
                assert figure == pytest.approx(
                    kind.candidates[names[name[0].upper()]][device][r][0], rel=1e-5
                )
        personal = [f for f, _ in kind.candidates[field_accuracy.PERSONAL][device]]
        assert personal == pytest.approx(kind.per_device["personalized"][device], rel=1e-5)

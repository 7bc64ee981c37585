"""The studies' device (``benchmarks.served_device``) is ``edge-trainer``'s serving: its judge and its
gate, so a study's served figure can be an earlier round's model that the gate kept."""

from __future__ import annotations

from benchmarks.served_device import ServedDevice
from tests.edge.test_serving import SPEC, linear, rows
from trainer_lite.algorithms import make_client
from trainer_lite.task import TaskSpec


def test_the_studies_device_serves_what_the_gate_lets_serve(tmp_path):
    algo = make_client(TaskSpec.from_json(SPEC))
    device = ServedDevice("p1", "speed", tmp_path)
    none = rows(0, 0)
    first = device.offer(algo, linear(2.0, 0.5), {}, rows(40, 0), none, 0)
    assert first is not None and not first.kept
    assert first.model.round == 0 and first.model.candidate == "personal"  # the line itself
    # The round's judgement comes back with it: the candidates it chose among, scored on the newest rows.
    assert set(first.choice.candidates) == {"personal", "global", "alone"}
    assert set(first.choice.evidence["scores"]) == set(first.choice.candidates)
    # New rows, and a round whose models are all far off them (the alone copy has had two rounds of
    # steps from its seeded start): the gate keeps round 0's model, as a device's does.
    kept = device.offer(algo, linear(-1.0, 0.0), {}, rows(40, 1), none, 1)
    assert kept.kept and kept.model is first.model
    assert kept.choice.candidates["personal"].round == 1  # judged, then refused by the gate
    assert device.refused is not None and "by more than the margin" in device.refused

"""benchmarks.wear_alert, small: the serving models of round 8 and round 40 each raise the worn-tool alert
after the tool starts to wear, never before, before the log's first worn label lands, and never clear
it while the tool stays worn; the round-40 model is never later than the round-8 one (orderings and
counts of welds, never times)."""

from __future__ import annotations

import pytest

from benchmarks import wear_alert


@pytest.fixture(scope="module")
def result() -> wear_alert.Result:
    return wear_alert.run(n_welders=2, seeds=[0, 1])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["round 8", "round 40"])
def test_the_alert_comes_after_the_onset_before_the_label_and_stays_open(result, model):
    for outcome, stream, label in zip(result.outcomes[model], result.streams, result.labels, strict=True):
        where = f"{model}, {stream.device} {stream.run} (onset weld {stream.onset})"
        welds = outcome.welds_to_alert(stream.onset)
        assert welds is not None and welds >= 1, f"{where}: raised {outcome.raises}"
        assert outcome.false_alerts(stream.onset) == 0, f"{where}: raised {outcome.raises}"
        assert label is not None and welds < label, f"{where}: alert after {welds} welds, label after {label}"
        assert outcome.false_clears(stream.onset) == 0, f"{where}: cleared {outcome.clears}"
        assert outcome.open_at_end, where
        assert len(outcome.p_worn) == len(stream.welds)  # every weld answered through the Server


@pytest.mark.slow
def test_the_round_40_model_is_never_later_than_the_round_8_one(result):
    early, late = result.outcomes["round 8"], result.outcomes["round 40"]
    for a, b, s in zip(early, late, result.streams, strict=True):
        wa, wb = a.welds_to_alert(s.onset), b.welds_to_alert(s.onset)
        assert wa is not None and wb is not None and wb <= wa, f"{s.device} {s.run}: {wb} vs {wa}"


@pytest.mark.slow
def test_no_rule_fed_the_true_class_raises_before_a_worn_weld(result):
    """The oracle reference: the rule needs k worn welds, so it raises at the k-th worn weld at the earliest."""
    for outcome, stream in zip(result.outcomes["oracle"], result.streams, strict=True):
        first = outcome.first_raise(stream.onset)
        worn = [i for i, w in enumerate(stream.welds) if w.tool == wear_alert.WORN]
        assert first is not None and first >= worn[wear_alert.RULE.k - 1]
        assert outcome.false_clears(stream.onset) == 0


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert wear_alert.main(["--welders", "1", "--no-write"]) == 2
    assert wear_alert.main(["--rounds", "0", "8", "--no-write"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("--welders must be >= 2" in line for line in err), err

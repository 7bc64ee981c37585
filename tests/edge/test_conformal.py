"""An interval on every answer: the split-conformal quantile (a property test on exchangeable
data), the interval or set and ``in_range`` each answer carries, the alert rules that take no
vote from untrusted answers (the documented ``shaky_layers`` example), and coverage as labels
arrive."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.config import DeviceConfig
from edge.serving.conformal import Calibration, covers, needed, quantile
from edge.serving.field import FieldScores
from edge.serving.model import ServingModel
from edge.serving.offers import model_path
from edge.serving.records import Answer, Row
from edge.serving.server import Server
from ioft_protocol.config import ConfigError, build
from tests.budget import examples
from tests.e2e.test_readme_formats import example
from tests.edge.test_serving import layer, linear, offer, server
from tests.edge.test_serving_watch import WELD_SPEC, linear_2x2, weld_answer
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

TRIALS = 5000  # draws of (n calibration rows, 1 new row) per example


# -- the quantile ---------------------------------------------------------------------------
@settings(max_examples=examples(25), deadline=None)
@given(
    level=st.sampled_from([0.8, 0.9, 0.95]),
    n=st.integers(2, 60),
    dist=st.sampled_from(["normal", "exponential", "uniform", "lumpy"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_on_exchangeable_rows_the_interval_holds_at_least_the_level_on_average(level, n, dist, seed):
    """Split conformal's guarantee: ``level <= P(new score <= q) <= level + 1/(n+1)`` (the upper
    bound for scores without ties; too few rows: no bound, and every row is held), checked over
    many draws within 4 standard errors."""
    rng = np.random.default_rng(seed)
    draw = {
        "normal": lambda size: np.abs(rng.normal(size=size)),
        "exponential": lambda size: rng.exponential(size=size),
        "uniform": lambda size: rng.uniform(size=size),
        "lumpy": lambda size: np.abs(rng.standard_t(2, size=size)) * 5,  # heavy tails
    }[dist]
    rows = draw((TRIALS, n + 1))
    qs = [quantile(rows[i, :n], level) for i in range(TRIALS)]
    held = [q is None or rows[i, n] <= q for i, q in enumerate(qs)]
    assert (qs[0] is None) == (n < needed(level))
    se = math.sqrt(level * (1 - level) / TRIALS)
    assert np.mean(held) >= level - 4 * se
    assert np.mean(held) <= (1.0 if n < needed(level) else level + 1 / (n + 1) + 4 * se)


def test_too_few_rows_give_no_finite_quantile():
    assert needed(0.9) == 9 and needed(0.8) == 4 and needed(0.95) == 19
    assert quantile(list(range(8)), 0.9) is None
    assert quantile(list(range(1, 10)), 0.9) == 9  # the 9th of 9: ceil(10 * 0.9)
    assert quantile(list(range(1, 20)), 0.9) == 18  # ceil(20 * 0.9) = 18
    short = Calibration([1.0, 2.0])
    assert short.interval(40.0, 0.9) == {"level": 0.9, "n": 2, "calibrated": False, "interval": None}
    assert short.prediction_set(["a", "b"], [0.99, 0.01], 0.9)["set"] == ["a", "b"]


# -- what each answer carries -----------------------------------------------------------------
def noisy_rows(n: int, seed: int, lo: float = 0.0, hi: float = 1.0) -> Dataset:
    """``y = 2x + 0.5`` plus noise of 0.02 (1 mm/s), as a printer's dataset stores them."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(lo, hi, (n, 1))
    return Dataset(x, 2 * x + 0.5 + rng.normal(0, 0.02, (n, 1)))


def test_a_layer_answer_carries_its_interval_and_whether_its_row_is_in_the_trained_range(tmp_path):
    published: list = []
    srv = server(tmp_path, published, coverage=0.8)
    test = noisy_rows(30, 1)
    assert offer(srv, linear(2.0, 0.5), 1, test=test)  # trained on x in [0, 1]
    model = srv.models["speed"]
    q = quantile(np.abs(test.y[:, 0] - (2 * test.x[:, 0] + 0.5)) * 50, 0.8)
    assert q is not None and model.speed_margin(0.8) == pytest.approx(q, rel=1e-5)
    srv.answer(layer("j#1/1", 0.5, commanded=50.0))
    srv.answer(layer("j#1/2", 1.5, commanded=50.0))  # vibrates more than any training row
    inside, outside = (json.loads(p) for _, p in published)
    assert inside["conformal"]["level"] == 0.8 and inside["conformal"]["calibrated"] is True
    assert inside["conformal"]["interval"] == pytest.approx([75.0 - q, 75.0 + q], abs=1e-3)
    assert inside["in_range"] is True and outside["in_range"] is False
    # Saved and read back: the range and the scores (now 30 test rows + 2 layers) come with the model.
    again = ServingModel.load(model_path(tmp_path, "speed"), device="p1", task="speed")
    assert again is not None and again.x_high is not None and 0.9 < again.x_high[0] <= 1.0
    assert len(again.calibration) == 30 and len(model.calibration) == 32
    assert again.answer(layer("j#1/3", 1.5)).in_range is False


def test_a_weld_answer_carries_a_prediction_set_all_classes_until_calibrated(tmp_path):
    model = ServingModel("p1", "tool", WELD_SPEC, 1, linear_2x2(), {}, width=2, classes=["TC1", "TC4"])
    x = np.array([[3.0, 0.0], [0.0, 3.0]] * 10)  # sure of each class: 1 - p(true) ~ 0.05
    train = Dataset(x, np.array([[0], [1]] * 10))
    model.calibrate(train, Dataset(x[:4], train.y[:4]))
    sure, unsure = Row("weld", "w1", 0.0, (3.0, 0.0)), Row("weld", "w2", 0.0, (0.2, 0.0))
    assert model.answer(sure).conformal == {"level": 0.9, "n": 4, "calibrated": False, "set": ["TC1", "TC4"]}
    model.calibrate(train, Dataset(x, train.y))
    assert model.answer(sure).conformal["set"] == ["TC1"] and model.answer(sure).in_range is True
    assert model.answer(unsure).conformal["set"] == []  # no class scores like the calibration rows
    assert model.answer(Row("weld", "w3", 0.0, (4.0, 0.0))).in_range is False
    assert model.speed_margin() is None


def test_a_bad_coverage_is_one_config_error():
    with pytest.raises(ConfigError, match="coverage"):
        build(DeviceConfig, {"device": "p1", "serve": {"coverage": 1.0}}, "device.toml")


# -- alerts that need a trusted answer ----------------------------------------------------------
GLM = TaskSpec("speed", "fedavg", "sigmoid_glm", hparams={"loss": "mse"})
#: speed/50 = 0.9 σ(5.756 σ_a − 0.799): 20 mm/s at σ_a 0.1, 40 at 0.5, and never above 45.
SATURATING = {"encoder.scale": np.array([5.756]), "encoder.shift": np.array([-0.799]),
              "decoder.weight": np.array([[0.9]]), "decoder.bias": np.array([0.0])}  # fmt: skip


def glm_rows(n: int, seed: int) -> Dataset:
    """Layers printed at 20..40 mm/s (σ_a 0.1..0.5) as the saturating model expects them."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.1, 0.5, (n, 1))
    y = 0.9 / (1 + np.exp(-(5.756 * x - 0.799))) + rng.normal(0, 0.01, (n, 1))
    return Dataset(x, y)


def shaky_server(tmp_path, alerts_toml: str) -> Server:
    raw = {"device": "p1", "state_dir": str(tmp_path), **tomllib.loads(alerts_toml)}
    srv = Server(build(DeviceConfig, raw, "alerts.toml"), tmp_path, lambda topic, payload: None)
    train, test = glm_rows(60, 0), glm_rows(20, 1)
    assert srv.offer("speed", make_client(GLM), SATURATING, {}, (train, test, None), (train, test, {}), 1)
    return srv


def test_the_documented_shaky_layers_rule_does_not_fire_from_a_model_outside_its_range(tmp_path):
    documented = example("alerts.toml")
    assert "require_in_range = true" in documented
    for toml, fires in [(documented, False), (documented.replace("require_in_range = true", ""), True)]:
        srv = shaky_server(tmp_path / str(fires), toml)
        for i in range(3):
            srv.answer(layer(f"j#1/{i}", 0.45, commanded=38.0))  # in range: within a few mm/s
        for i in range(3, 6):  # 70 mm/s vibrates at 0.9: the model saturates at 45 -> 25 mm/s off
            srv.answer(layer(f"j#1/{i}", 0.9, commanded=70.0))
        assert [a["rule"] for a in srv.alerts.status()] == (["shaky_layers"] if fires else [])
        assert srv.alerts.untrusted == (0 if fires else 3)


def with_set(answer: Answer, chosen: list[str], level: float = 0.9) -> Answer:
    return dataclasses.replace(answer, conformal={"level": level, "n": 50, "calibrated": True, "set": chosen})


def test_require_confident_takes_votes_only_from_one_class_sets(tmp_path):
    raw = {"device": "w1", "serve": {"alerts": [{"name": "worn", "task": "tool", "value": "p:TC4",
                                                 "above": 0.8, "k": 2, "n": 2, "require_confident": True}]}}  # fmt: skip
    srv = Server(build(DeviceConfig, raw, "device.toml"), tmp_path, lambda topic, payload: None)
    sure = [with_set(weld_answer(f"w{i}", 0.95, i), ["TC4"] if i >= 2 else ["TC1", "TC4"]) for i in range(4)]
    assert [e.state for a in sure[:2] for e in srv.alerts.observe(a)] == []  # two-class sets: no vote
    assert [e.state for a in sure[2:] for e in srv.alerts.observe(a)] == ["raised"]


# -- coverage as labels arrive ------------------------------------------------------------------
def test_coverage_counts_calibrated_answers_and_labels_grow_the_calibration(tmp_path):
    published: list = []
    srv = server(tmp_path, published, field_window=50)
    assert offer(srv, linear(2.0, 0.5), 1, test=noisy_rows(5, 1))  # 5 test rows: too few at 0.9
    model = srv.models["speed"]
    rng = np.random.default_rng(3)
    for i in range(60):  # commanded speeds scattered 4 mm/s (sd) around what the model expects
        srv.answer(layer(f"j#1/{i}", 0.5, commanded=75.0 + rng.normal(0, 4.0)))
    assert len(model.calibration) == 65  # every layer's residual joined the test rows'
    cov = srv.status()["field"]["speed"]["coverage"]
    # The first 4 answers had no finite interval (5..8 scores): they are not counted.
    assert cov["scored"] == 56 and cov["n"] == 50 and cov["level"] == 0.9
    answers = [Answer.from_dict(json.loads(p)) for _, p in published]
    assert [a.conformal["calibrated"] for a in answers[:5]] == [False] * 4 + [True]
    assert cov["all"] == pytest.approx(np.mean([covers(a, a.commanded) for a in answers[4:]]))
    assert 0.75 <= cov["all"] <= 1.0


def test_a_weld_set_is_scored_when_its_label_arrives():
    field = FieldScores(window=4, margin=0.1)
    for i, (p, s) in enumerate([(0.9, ["TC4"]), (0.9, ["TC4"]), (0.6, ["TC1", "TC4"]), (0.2, ["TC1"])]):
        field.answered(with_set(weld_answer(f"w{i}", p), s, level=0.8))
    raw = weld_answer("w9", 0.9)  # no calibrated set: field accuracy only
    field.answered(raw)
    for key, label in [("w0", "TC4"), ("w1", "TC1"), ("w2", "TC1"), ("w3", "TC4"), ("w9", "TC4")]:
        field.label(key, label)
    assert field.status({})["tool"]["coverage"] == {
        "level": 0.8,
        "value": 0.5,
        "n": 4,
        "all": 0.5,
        "scored": 4,
    }
    assert field.status({})["tool"]["n"] == 4  # window 4 of the 5 scored


def test_a_weld_label_adds_its_score_to_the_serving_models_calibration(tmp_path):
    srv = server(tmp_path)
    model = ServingModel("p1", "tool", WELD_SPEC, 1, linear_2x2(), {}, width=2, classes=["TC1", "TC4"])
    x = np.array([[3.0, 0.0], [0.0, 3.0]] * 5)
    model.calibrate(Dataset(x, np.array([[0], [1]] * 5)), Dataset(x, np.array([[0], [1]] * 5)))
    srv.models["tool"] = model
    srv.answer(Row("weld", "w1", 0.0, (0.0, 3.0)))  # says TC4, sure
    srv.answer(Row("weld", "w2", 0.0, (1.0, 0.0)))  # says TC1, unsure: an empty set
    srv.label({"kind": "label", "key": "w1", "label": "TC4"})
    srv.label({"kind": "label", "key": "w2", "label": "TC4"})  # wrong, and outside its set
    assert len(model.calibration) == 12
    assert model.calibration.scores[-1] == pytest.approx(1 - 1 / (1 + math.e))  # 1 - p(TC4) at (1, 0)
    want = {"level": 0.9, "value": 0.5, "n": 2, "all": 0.5, "scored": 2}
    assert srv.status()["field"]["tool"]["coverage"] == want

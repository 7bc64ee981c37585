"""Advice that can never harm a printer: its ceilings, no advice (and why) where the model knows
nothing, and Moonraker (a stand-in keeping Klipper's limits as Klipper does) taking it off the answer
path, read back, restored; the hostile cases: 17,550 mm/s, a negative speed, a Moonraker that hangs."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edge.config import DeviceConfig, SensorsConfig, ServeConfig
from edge.serving.advice import speed_advice
from edge.serving.candidates import Choice
from edge.serving.server import Server
from ioft_protocol.config import ConfigError, build
from sensors.sim.printer_host import FakeMoonraker, HungMoonraker, short_timeline
from tests.edge.test_serving import SPEC, layer, linear, rows
from tests.edge.test_serving_watch import wait_for
from trainer_lite.algorithms import make_client
from trainer_lite.data import Dataset
from trainer_lite.task import TaskSpec

CRAFTED = linear(351.0, 0.0)  # speed/50 = 351 sigma_a: 17,550 mm/s at sigma_a 1.0


@pytest.fixture(autouse=True)
def personal_serves(monkeypatch):
    """The model offered serves, whatever the device's other candidates score: these tests are about
    the advice a serving model gives (tests/edge/test_candidates.py is about which one serves)."""

    def only_personal(personal, algo, shared, fit, newest, scaler, state_dir, encoder, min_rows, every=None):
        score, metric = personal.score(newest) if len(newest) else (None, "none")
        personal.metric, personal.metric_name = score, metric
        personal.evidence = {"rows": len(newest), "metric": metric, "scores": {"personal": score},
                             "why": "the offered model (test)"}  # fmt: skip
        return Choice(personal, personal.evidence, {"personal": personal}, personal)

    monkeypatch.setattr("edge.serving.offers.choose", only_personal)


@pytest.fixture
def klipper():
    """A Moonraker stand-in on a free loopback port: max_velocity 300 (live and configured), printing."""
    timeline, _ = short_timeline(time.monotonic(), layers=1, dur=1.0)
    moonraker = FakeMoonraker(timeline, time.monotonic, max_velocity=300.0)
    moonraker.print_state = "printing"
    yield moonraker
    moonraker.close()


def printer(tmp_path: Path, url: str, published: list | None = None, **serve) -> Server:
    cfg = {"vibration_budget": 1.0, "apply": "moonraker", "dry_run": False, "moonraker_url": url} | serve
    config = DeviceConfig(device="p1", state_dir=str(tmp_path), serve=ServeConfig(**cfg),
                          sensors=SensorsConfig(kind="printer"))  # fmt: skip
    out = published if published is not None else []
    srv = Server(config, tmp_path, lambda topic, payload: out.append(json.loads(payload)))
    srv.moonraker.watch_s = 0.05  # the print state is polled often in a test
    return srv


def offer(srv: Server, params: dict, task: str = "speed", train: Dataset | None = None,
          test: Dataset | None = None) -> bool:  # fmt: skip
    algo = make_client(TaskSpec.from_json(SPEC.replace('"speed"', f'"{task}"')))
    train = train if train is not None else rows(40, 0)  # 25..125 mm/s, sigma_a 0..1
    test = test if test is not None else train
    return srv.offer(task, algo, params, {}, (train, test, None), (train, test, {}), 1)


def sent(moonraker: FakeMoonraker) -> list[float]:
    return [float(s.split("=")[1]) for s in moonraker.scripts if s.startswith("SET_VELOCITY_LIMIT")]


# -- the advice itself --------------------------------------------------------------------
def test_a_model_advising_17550_mm_s_is_capped_at_the_least_ceiling(tmp_path, klipper):
    srv = printer(tmp_path, klipper.url, max_advice=100.0)
    assert offer(srv, CRAFTED)  # R² = 1 is not what it was trained on: the gate has nothing to say
    model = srv.models["speed"]
    assert speed_advice(model, 1.0, ceiling={}).speed == pytest.approx(17550.0, rel=1e-3)
    assert model.speed_max == pytest.approx(125.0, abs=1.0)  # the fastest training row
    assert srv.status()["advice"]["speed"] | {"vibration_budget": None} == {
        "speed": 100.0, "capped_by": "max_advice", "vibration_budget": None}  # fmt: skip
    # Without an operator ceiling: the fastest trained speed; a printer slower still: its own limit.
    klipper.max_velocity = klipper.config_max_velocity = 90.0
    srv = printer(tmp_path / "b", klipper.url)
    offer(srv, CRAFTED)
    assert srv.status()["advice"]["speed"]["capped_by"] == "trained"
    srv.answer(layer("job#1/0", 0.5))
    wait_for(lambda: srv.moonraker.sent == 1, "the advice sent")
    assert sent(klipper) == [90.0] and klipper.max_velocity == 90.0
    assert srv.status()["advice"]["speed"] == {"speed": 90.0, "capped_by": "printer", "vibration_budget": 1.0}
    srv.close()


def test_a_negative_speed_is_no_advice_and_says_why(tmp_path, klipper):
    published: list = []
    srv = printer(tmp_path, klipper.url, published)
    offer(srv, linear(0.0, -1.0))  # expects -50 mm/s everywhere
    advice = srv.status()["advice"]["speed"]
    assert advice["speed"] is None and "mm/s, is below min_advice 5" in advice["why"]
    assert srv.answer(layer("job#1/0", 0.5)) == 1 and "advice" not in published[-1]
    srv.close()
    assert klipper.scripts == [] and srv.moonraker.sent == 0


def test_a_printer_that_never_vibrated_within_the_budget_gets_no_advice(tmp_path, klipper):
    """printer2 at budget 0.8: every layer it printed vibrated at sigma_a >= 1.1; a linear model
    extrapolated to 40.3 mm/s at 0.8 and advised it."""
    data = rows(40, 0)
    srv = printer(tmp_path, klipper.url, vibration_budget=0.8)
    offer(srv, linear(1.0, 0.0), train=Dataset(data.x + 1.1, data.x + 1.1))  # 40 mm/s at 0.8, 55 at 1.1
    advice = srv.status()["advice"]["speed"]
    assert advice["speed"] is None and "above the budget" in advice["why"]
    srv.close()
    assert klipper.scripts == []


# -- Moonraker: read, send, read back, restore -----------------------------------------------
def test_the_printer_limit_is_read_first_read_back_and_restored_when_the_print_ends(tmp_path, klipper):
    klipper.max_velocity = 250.0  # a live limit below the configured 300: that is what comes back
    srv = printer(tmp_path, klipper.url)
    offer(srv, linear(2.0, 0.5))  # 125 mm/s at sigma_a 1.0, and the fastest trained is ~125
    srv.answer(layer("job#1/0", 0.5))
    srv.answer(layer("job#1/1", 0.5))  # the same print run: sent once
    wait_for(lambda: srv.moonraker.sent == 1, "the advice sent")
    speed = sent(klipper)[0]
    assert klipper.max_velocity == speed < 250.0
    m = srv.status()["moonraker"]
    assert (m["own_limit"], m["printer_max_velocity"], m["readback_mismatch"], m["in_effect"]) == (
        250.0, 250.0, 0, speed)  # fmt: skip
    klipper.print_state = "complete"
    wait_for(lambda: srv.moonraker.restored == 1, "the printer's own limit restored")
    assert klipper.max_velocity == 250.0 and sent(klipper) == [speed, 250.0]
    assert srv.status()["moonraker"]["in_effect"] is None
    klipper.print_state = "printing"  # the next print: read again, sent again, restored at close
    srv.answer(layer("job#2/0", 0.5))
    wait_for(lambda: srv.moonraker.sent == 2, "the next print's advice")
    srv.close()
    assert srv.moonraker.restored == 2 and klipper.max_velocity == 250.0


def test_a_change_the_toolhead_does_not_show_is_counted(tmp_path, klipper):
    klipper.stuck = True
    srv = printer(tmp_path, klipper.url)
    offer(srv, linear(2.0, 0.5))
    srv.answer(layer("job#1/0", 0.5))
    wait_for(lambda: srv.moonraker.sent == 1, "the advice sent")
    assert srv.status()["moonraker"]["readback_mismatch"] == 1
    srv.close()


def test_the_limit_is_restored_when_the_serving_model_stops_advising(tmp_path, klipper):
    srv = printer(tmp_path, klipper.url)
    offer(srv, linear(2.0, 0.5))
    srv.answer(layer("job#1/0", 0.5))
    wait_for(lambda: srv.moonraker.sent == 1, "the advice sent")
    x = np.linspace(0, 1, 20).reshape(-1, 1)
    assert offer(srv, linear(0.0, -1.0), train=Dataset(x, -np.ones_like(x)))  # it wins the gate there
    wait_for(lambda: srv.moonraker.restored == 1, "the restore")
    assert klipper.max_velocity == 300.0
    srv.close()


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_the_limit_is_restored_when_the_serving_model_answers_inf_and_is_taken_out(tmp_path, klipper):
    srv = printer(tmp_path, klipper.url)
    offer(srv, linear(3e38, 0.0))  # finite on its rows (sigma_a <= 1), Inf at 10; advice capped at ~125
    srv.answer(layer("job#1/0", 0.5))
    wait_for(lambda: srv.moonraker.sent == 1, "the advice sent")
    assert srv.answer(layer("job#1/1", 10.0)) == 0 and "speed" not in srv.models  # not finite: out
    wait_for(lambda: srv.moonraker.restored == 1, "the restore")
    assert klipper.max_velocity == 300.0
    srv.close()


def test_max_advice_above_the_printer_limit_applies_nothing_and_says_so(tmp_path, klipper):
    klipper.config_max_velocity = 200.0
    srv = printer(tmp_path, klipper.url, max_advice=250.0)
    offer(srv, CRAFTED)
    srv.answer(layer("job#1/0", 0.5))
    wait_for(lambda: srv.moonraker.refused is not None, "the refusal")
    assert "max_advice 250 is above the printer's max_velocity 200" in srv.status()["moonraker"]["refused"]
    assert klipper.scripts == [] and srv.status()["advice"]["speed"]["speed"] <= 200.0
    srv.close()


def test_with_two_printer_tasks_only_the_configured_one_is_applied(tmp_path, klipper):
    srv = printer(tmp_path, klipper.url)
    offer(srv, linear(2.0, 0.5), "speed")
    own = rows(40, 0)
    own = Dataset(own.x, own.x + 0.5)  # speed2's own rows: its answers hold, its interval is narrow
    offer(srv, linear(1.0, 0.5), "speed2", own)  # 75 mm/s at 1.0
    srv.answer(layer("job#1/0", 0.5))
    assert "advice_task is unset" in srv.status()["moonraker"]["refused"]
    chosen = printer(tmp_path / "b", klipper.url, advice_task="speed2")
    offer(chosen, linear(2.0, 0.5), "speed")
    offer(chosen, linear(1.0, 0.5), "speed2", own)
    chosen.answer(layer("job#1/0", 0.5, commanded=50.0))  # the model's own expectation: no wider interval
    wait_for(lambda: chosen.moonraker.sent == 1, "the advice sent")
    (speed,) = sent(klipper)  # speed2's: 75 mm/s at the budget, under its fastest trained row (74.8)
    assert 74.0 <= speed <= 75.0
    srv.close()
    chosen.close()


def test_a_moonraker_that_never_answers_delays_no_answer_and_piles_up_no_thread(tmp_path):
    hung = HungMoonraker()
    srv = printer(tmp_path, hung.url)
    srv.moonraker.timeout_s, srv.moonraker.retries = 3.0, 1  # a failure is counted after 6 s
    offer(srv, linear(2.0, 0.5))
    try:
        before = threading.active_count()
        made = sum(srv.answer(layer(f"job#{i}/0", 0.5)) for i in range(40))  # 40 print runs
        # Every answer was made while the worker still waits on its first call: none waited for it.
        assert made == 40 and srv.moonraker.failed == 0
        assert srv.moonraker.dropped >= 40 - 1 - 8  # a bounded queue: the rest is dropped, counted
        assert threading.active_count() <= before + 1
        assert sum(t.name == "moonraker" for t in threading.enumerate()) == 1
        wait_for(lambda: srv.moonraker.failed >= 1, "the failure counted")
        assert "could not read the printer's max_velocity" in srv.status()["moonraker"]["last_error"]
    finally:
        srv.moonraker.timeout_s, srv.moonraker.retries = 0.2, 0
        srv.close()
        hung.close()


# -- refused at start -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"serve": {"min_advice": -1.0}}, "serve.min_advice must be a speed >= 0"),
        ({"serve": {"max_advice": 0.0}}, "serve.max_advice must be a speed > 0"),
        ({"serve": {"moonraker_url": "127.0.0.1:7125"}}, "must start with http:// or https://"),
        (
            {"tasks": ["a", "b"], "serve": {"vibration_budget": 1.0, "apply": "moonraker"}},
            "serve.advice_task",
        ),
        ({"tasks": ["a"], "serve": {"advice_task": "b"}}, "is not one of the tasks"),
    ],
)
def test_unsafe_advice_settings_are_refused_at_start_in_one_line(raw, words):
    with pytest.raises(ConfigError) as err:
        build(DeviceConfig, {"device": "p1", **raw}, "device.toml")
    assert words in str(err.value) and len(str(err.value).splitlines()) == 2  # the header, one problem


def test_advice_is_the_conservative_edge_of_the_interval_and_none_before_it_is_calibrated(tmp_path, klipper):
    """The advice is the interval's lower end at the budget (expected less the conformal half-width);
    a model whose interval is not calibrated yet advises nothing, and says why."""
    srv = printer(tmp_path, klipper.url, max_advice=250.0)
    train = rows(40, 0)
    offer(srv, linear(2.0, 0.5), "speed", train, Dataset(train.x[:0], train.y[:0]))  # no rows to calibrate
    model = srv.models["speed"]
    model.calibration.scores.clear()  # (the offer had no held-out rows to start it from)
    advice = srv.status()["advice"]["speed"]
    assert advice["speed"] is None and "not calibrated" in advice["why"]
    for _ in range(30):  # labelled layers, each 10 mm/s off: the 90 % half-width becomes 10 mm/s
        model.calibration.add(10.0)
    margin = model.speed_margin(0.9)
    assert margin == pytest.approx(10.0)
    expected = speed_advice(model, 1.0, ceiling={}).speed  # 125 mm/s at sigma_a 1.0
    assert srv.status()["advice"]["speed"]["speed"] == pytest.approx(min(expected, 125.0) - margin, abs=0.5)
    srv.close()

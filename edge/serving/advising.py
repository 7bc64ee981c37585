"""The speed advice on the answer path and its way to the printer's Moonraker.

:class:`Advising` computes each printer task's advice under ``[serve] vibration_budget``
(:mod:`edge.serving.advice`, cached per model and ceilings), puts it on the task's answers, and,
with ``[serve] apply = "moonraker"``, hands it to :class:`edge.serving.moonraker.MoonrakerApply`
once per print run (whose worker thread talks to Moonraker, never the serving thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from edge.config import DeviceConfig
from edge.serving.advice import Advice, ceilings, speed_advice
from edge.serving.model import Refused, ServingModel
from edge.serving.moonraker import MoonrakerApply
from edge.serving.records import Answer

log = logging.getLogger(__name__)


def moonraker_for(config: DeviceConfig) -> MoonrakerApply | None:
    """The Moonraker the advice goes to (``[serve] apply = "moonraker"``), else ``None``."""
    cfg, sensors = config.serve, config.sensors
    if cfg.apply != "moonraker":
        return None
    url = cfg.moonraker_url or (sensors.moonraker_url if sensors is not None else None)
    key = sensors.moonraker_api_key if sensors is not None else None
    return MoonrakerApply(
        url or "http://127.0.0.1:7125", cfg.dry_run, key, cfg.max_advice, device=config.device
    )


class Advising:
    """The advice of the models in ``models`` (the server's, swapped in place) for the tasks ``serves``.

    Parameters
    ----------
    config
        The device's config (``[serve]`` and its id).
    models
        task -> its serving model: the server's own dict, read here.
    serves
        Whether a task answers rows here.
    """

    def __init__(
        self, config: DeviceConfig, models: dict[str, ServingModel], serves: Callable[[str], bool]
    ) -> None:
        self.cfg, self.device = config.serve, config.device
        self.models, self.serves = models, serves
        self.moonraker = moonraker_for(config)
        self.cache: dict[str, tuple[tuple, Advice]] = {}  # task -> ((model digest, ceilings), advice)
        self._apply_refused: str | None = None  # several tasks advise and none is the advice_task
        self._last_run: str | None = None
        self._moonraker_seen: tuple = ()  # Moonraker's counts at the last changed()
        self._applied_task: str | None = None  # the task whose advice was last sent

    def advice_for(self, task: str, model: ServingModel) -> Advice | None:
        """The speed advice of ``model`` under ``[serve] vibration_budget`` (``None``: no budget), under
        the least of its ceilings known now (cached per model and ceilings)."""
        budget = self.cfg.vibration_budget
        if budget is None:
            return None
        printer_max = self.moonraker.printer_max if self.moonraker is not None else None
        limits = ceilings(model, self.cfg.max_advice, printer_max)
        # The conservative edge: the interval's lower end at this coverage (it narrows as labels come).
        margin = model.speed_margin(self.cfg.coverage)
        key = (model.digest, tuple(sorted(limits.items())), margin)
        cached = self.cache.get(task)
        if cached is None or cached[0] != key:
            if margin is None:
                advice = Advice(
                    None,
                    f"too few labelled layers to bound its answers at {self.cfg.coverage:.0%} coverage "
                    f"(its interval is not calibrated yet)",
                )
            else:
                try:
                    advice = speed_advice(model, budget, self.cfg.min_advice, margin=margin, ceiling=limits)
                except Refused as exc:
                    advice = Advice(None, f"the model cannot answer: {exc}")
            cached = self.cache[task] = (key, advice)
        return cached[1]

    def with_advice(self, task: str, model: ServingModel, ans: Answer) -> Answer:
        """``ans`` with its model's speed advice, where a layer's answer has one."""
        advice = self.advice_for(task, model) if ans.kind == "layer" else None
        if advice is None or advice.speed is None:
            return ans
        ans.extra["advice"] = {"speed": advice.speed, "vibration_budget": self.cfg.vibration_budget}
        return ans  # its extra is its own: ServingModel.answer made it

    def advice_task(self) -> str | None:
        """The task whose advice goes to the printer: ``[serve] advice_task``, else the only printer
        task serving here (several and none configured: none, and the status says so)."""
        if self.cfg.advice_task is not None:
            return self.cfg.advice_task
        printers = sorted(t for t, m in list(self.models.items()) if m.classes is None and self.serves(t))
        if len(printers) > 1:
            if self._apply_refused is None:
                self._apply_refused = (
                    f"tasks {', '.join(printers)} all advise and serve.advice_task is unset: nothing is "
                    "applied until it names one"
                )
                log.error("%s: %s", self.device, self._apply_refused)
            return None
        self._apply_refused = None
        return printers[0] if printers else None

    def maybe_apply(self, ans: Answer) -> bool:
        """The advice to Moonraker once per print run, at its first answered layer (queued: the
        worker thread talks to Moonraker, never this one); whether it went."""
        advice = ans.extra.get("advice")
        if self.moonraker is None or advice is None or ans.task != self.advice_task():
            return False
        run = ans.key.rsplit("/", 1)[0]
        if run == self._last_run:
            return False
        self._last_run, self._applied_task = run, ans.task
        self.moonraker.apply(run, float(advice["speed"]))
        return True

    def model_changed(self, task: str) -> None:
        """``task``'s serving model changed: if the applied task no longer advises, restore the printer."""
        if self.moonraker is None or task != self._applied_task:
            return
        model = self.models.get(task)
        advice = self.advice_for(task, model) if model is not None else None
        if advice is None or advice.speed is None:
            self._last_run = None  # the next print run gets the advice again, if any comes back
            self.moonraker.restore(f"task {task}'s serving model stopped advising")

    def moonraker_changed(self) -> bool:
        """Whether Moonraker's counts or error changed since the last call (its worker thread fails
        or sends after the answer went out)."""
        if self.moonraker is None:
            return False
        m = self.moonraker
        now = (m.sent, m.would_send, m.failed, m.restored, m.refused, m.last_error)
        changed = now != self._moonraker_seen
        self._moonraker_seen = now
        return changed

    def moonraker_status(self) -> dict[str, Any]:
        """Moonraker's part of the serving status."""
        assert self.moonraker is not None
        out = self.moonraker.status() | {"advice_task": self.advice_task()}
        if self._apply_refused is not None and out["refused"] is None:
            out["refused"] = self._apply_refused
        return out

    def status(self) -> dict[str, dict[str, Any]]:
        """Each printer task's advice under the budget: the status's ``advice``."""
        return {
            t: {**a.to_dict(), "vibration_budget": self.cfg.vibration_budget}
            for t, m in list(self.models.items())
            if m.classes is None and (a := self.advice_for(t, m)) is not None
        }

    def close(self) -> None:
        if self.moonraker is not None:
            self.moonraker.close()  # puts the printer's own limit back

"""``[serve]`` of ``device.toml``: the answers to every row and their alert rules (:class:`ServeConfig`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ioft_protocol.codec import check_id
from sensors.files import DEFAULT_MAX_FILE_BYTES

#: What an alert rule reads from an answer (``p:<class>``: that class's probability).
ALERT_VALUES = ("residual", "abs_residual", "expected_speed", "p:<class>")
#: The longest operator's text (an alert's ``action``, a class meaning in ``[serve.classes]``).
MAX_WORDS = 200
#: Home Assistant's discovery prefix: topic levels without wildcards (``#``, ``+``) or empty levels.
_DISCOVERY_PREFIX = re.compile(r"[^/#+\x00]+(/[^/#+\x00]+)*")
#: Where speed advice goes: nowhere (published only) or the printer's Moonraker.
APPLY_CHOICES = ("none", "moonraker")


@dataclass(frozen=True)
class AlertRule:
    """``[[serve.alerts]]``: raise an alert when ``k`` of a task's last ``n`` answers read over a threshold.

    Parameters
    ----------
    name
        The alert's id (its MQTT topic ``alert/<device>/<name>``, its entry in the status).
    task
        The task whose answers it reads.
    value
        What it reads from each answer: ``p:<class>`` (that class's probability, welds),
        ``residual``, ``abs_residual`` or ``expected_speed`` (mm/s, layers).
    above
        Raised when at least ``k`` of the last ``n`` values are above this.
    k, n
        The vote (``1 <= k <= n <= 1000``).
    clear_below
        Hysteresis: an open alert clears when at least ``k`` of the last ``n`` values are
        at or below this (default: ``above``; must not exceed it).
    cooldown_s
        After a clear, the rule does not raise again for this long (seconds of row time).
    require_in_range
        Only answers to rows within the range the serving model was trained on vote (a model
        asked far outside it, e.g. a saturating one, reads off by construction).
    require_confident
        Only answers whose conformal prediction set is one class vote (welds).
    action
        What the operator does when it raises, in their words (``"replace the horn"``): carried by
        the alert message, the status, ``fleet status``, the console and Home Assistant.
    """

    name: str
    task: str
    value: str
    above: float
    k: int = 3
    n: int = 3
    clear_below: float | None = None
    cooldown_s: float = 0.0
    require_in_range: bool = False
    require_confident: bool = False
    action: str | None = None

    def __post_init__(self) -> None:
        check_id("alert name", self.name)
        check_id("task", self.task)
        problems = []
        if self.value not in ALERT_VALUES[:-1] and not (self.value.startswith("p:") and len(self.value) > 2):
            problems.append(f"value must be one of {list(ALERT_VALUES)}, got {self.value!r}")
        if not 1 <= self.k <= self.n <= 1000:
            problems.append(f"need 1 <= k <= n <= 1000, got k = {self.k}, n = {self.n}")
        if self.clear_below is not None and self.clear_below > self.above:
            problems.append(f"clear_below ({self.clear_below}) must not exceed above ({self.above})")
        if not self.cooldown_s >= 0:
            problems.append(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        if self.action is not None and not 0 < len(self.action.strip()) <= MAX_WORDS:
            problems.append(f"action must be 1 to {MAX_WORDS} characters, such as 'replace the horn'")
        if problems:
            raise ValueError(f"alert {self.name!r}: " + "; ".join(problems))

    @property
    def class_name(self) -> str | None:
        """The class whose probability it reads (``value = "p:<class>"``), else ``None``."""
        return self.value[2:] if self.value.startswith("p:") else None

    @property
    def clear_at(self) -> float:
        return self.above if self.clear_below is None else self.clear_below


@dataclass(frozen=True)
class ServeConfig:
    """``[serve]``: the answers this machine's own models give to every new layer or weld (``edge.serving``).

    Parameters
    ----------
    enabled
        Answer rows at all (only a device whose rows come from ``edge-recorder``,
        ``[data] source = "state"``, has rows to answer).
    tasks
        The tasks that answer (empty: every task the device trains).
    margin
        The gate: the round's best candidate replaces the serving model unless its score on the
        device's newest rows (accuracy, or R²) is lower by more than this (as ``[model] rollback_margin``).
    log_max_bytes, log_keep, log_max_age_s
        The local answer log ``serving/answers.jsonl`` rotates at this size or age and keeps
        this many older files.
    vibration_budget
        Printers: the vibration (σ_a, the units the rows store) the speed advice keeps within;
        unset: no advice.
    min_advice
        The slowest speed (mm/s) ever advised (default 5): below it the model says nothing (an
        untrained model can expect 0 or a negative speed, and a velocity limit of that stalls a
        printer).  Only a test of the plumbing sets it lower.
    max_advice
        The operator's ceiling (mm/s, > 0): no advice is above it, nor above the fastest speed the
        model was trained on, nor above the printer's own ``max_velocity`` (read from Moonraker;
        a ``max_advice`` above that is refused there, in one line).
    advice_task
        With several printer tasks: the one whose advice is applied (unset with several: refused).
    apply
        ``"moonraker"``: send the advice to the printer's Moonraker when a print run's first
        layer is answered (``SET_VELOCITY_LIMIT VELOCITY=<advice>``, off the answer path, read back,
        and the printer's own limit restored when the print ends); ``"none"`` (default):
        publish it only.
    dry_run
        With ``apply = "moonraker"``: log (and count) what would be sent, send nothing (default).
    moonraker_url
        Where to send it (default: ``[sensors] moonraker_url``).
    field_window
        Field accuracy (welds) or error (layers) is over this many most recent scored answers.
    drift_margin
        Drift: field accuracy below the model's test-split accuracy by more than this, or field
        error above its test-split error by more than this fraction, once ``field_window // 2``
        answers are scored.
    coverage
        The level of the conformal interval (layers) or prediction set (welds) on every answer:
        it holds the truth for this fraction of rows (:mod:`edge.serving.conformal`).
    alerts
        The alert rules (:class:`AlertRule`, ``[[serve.alerts]]``).
    classes
        ``[serve.classes]``: what each class means, in the operator's words (``TC4 = "worn horn and
        worn anvil"``); the alert message, the status, ``fleet status``, the console and Home
        Assistant show it beside the class.  A name that is not one of the device's classes is refused.
    min_judge_rows
        The fewest newest rows (held out of training) that judge the task's candidate models
        (``edge.serving.candidates``); with fewer the fleet's model serves, through the cold start.
    holdout_fraction
        The share of the training rows, newest first, held out to judge the candidates (at
        least 1 of 2 or more rows).
    hold_out_always
        Hold the newest rows out of every round's training to judge the candidates from the first
        round, before any row is fed (default: once edge-recorder has fed a row; a device that
        answers nothing trains on every row, as the fleet's simulations do).  A simulated device
        (``--simulate printer --no-live``) then judges, serves and reports what it serves too:
        ``make demo``'s printers.
    home_assistant
        Announce this machine to Home Assistant by MQTT discovery (retained config messages on its
        own ``ioft/v1/<fleet>/ha/<device>/...``, which ``serve`` republishes, rebuilt, under
        ``homeassistant/``; :mod:`edge.serving.home_assistant`).
    discovery_prefix
        Read and checked for old configs, no longer used: ``serve`` publishes where Home Assistant
        reads (a device may not write under the prefix).
    max_file_bytes
        ``edge-trainer predict``: the largest input file it reads (default 32 MiB), checked against
        the file's size and what a weld file's header declares before anything is allocated.
    """

    enabled: bool = True
    tasks: list[str] = field(default_factory=list)
    margin: float = 0.05
    min_judge_rows: int = 5
    holdout_fraction: float = 0.2
    hold_out_always: bool = False
    log_max_bytes: int = 1 << 20
    log_keep: int = 4
    log_max_age_s: float = 86400.0
    vibration_budget: float | None = None
    min_advice: float = 5.0
    max_advice: float | None = None
    advice_task: str | None = None
    apply: str = "none"
    dry_run: bool = True
    moonraker_url: str | None = None
    field_window: int = 50
    drift_margin: float = 0.1
    coverage: float = 0.90
    alerts: list[AlertRule] = field(default_factory=list)
    classes: dict[str, str] = field(default_factory=dict)
    home_assistant: bool = False
    discovery_prefix: str = "homeassistant"
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES

    def __post_init__(self) -> None:
        # A bad task id raises at once (check_id); the other problems go out joined in one message.
        problems = self._answer_problems()
        problems += self._advice_problems()
        problems += self._watch_problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _answer_problems(self) -> list[str]:
        """The gate, the judging rows, the input files and the answer log."""
        problems = []
        if not self.max_file_bytes >= 1024:
            problems.append(f"serve.max_file_bytes must be >= 1024, got {self.max_file_bytes}")
        if not 0.0 <= self.margin <= 1.0:
            problems.append(f"serve.margin must be in [0, 1], got {self.margin}")
        if self.min_judge_rows < 1:
            problems.append(f"serve.min_judge_rows must be >= 1, got {self.min_judge_rows}")
        if not 0.0 < self.holdout_fraction < 1.0:
            problems.append(f"serve.holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.log_max_bytes < 4096 or self.log_keep < 1:
            problems.append("serve.log_max_bytes must be >= 4096 and serve.log_keep >= 1")
        if not self.log_max_age_s > 0:
            problems.append(f"serve.log_max_age_s must be > 0, got {self.log_max_age_s}")
        for task in self.tasks:
            check_id("task", task)
        return problems

    def _advice_problems(self) -> list[str]:
        """The speed advice and where it goes."""
        problems = []
        if self.vibration_budget is not None and not self.vibration_budget > 0:
            problems.append(
                f"serve.vibration_budget must be > 0 (units of sigma_a), got {self.vibration_budget}"
            )
        if not (math.isfinite(self.min_advice) and self.min_advice >= 0):
            problems.append(f"serve.min_advice must be a speed >= 0 mm/s, got {self.min_advice}")
        if self.max_advice is not None and not (math.isfinite(self.max_advice) and self.max_advice > 0):
            problems.append(f"serve.max_advice must be a speed > 0 mm/s, got {self.max_advice}")
        if self.advice_task is not None:
            check_id("task", self.advice_task)
        if self.moonraker_url is not None and not self.moonraker_url.startswith(("http://", "https://")):
            problems.append(
                f"serve.moonraker_url must start with http:// or https://, got {self.moonraker_url!r}"
            )
        if self.apply not in APPLY_CHOICES:
            problems.append(f"serve.apply must be one of {list(APPLY_CHOICES)}, got {self.apply!r}")
        if self.apply != "none" and self.vibration_budget is None:
            problems.append(
                f"serve.apply = {self.apply!r} needs serve.vibration_budget (the advice it sends)"
            )
        return problems

    def _watch_problems(self) -> list[str]:
        """Field scores, intervals, Home Assistant, the alert rules' names and the classes' words."""
        problems = []
        if self.field_window < 2:
            problems.append(f"serve.field_window must be >= 2, got {self.field_window}")
        if not 0.0 <= self.drift_margin <= 1.0:
            problems.append(f"serve.drift_margin must be in [0, 1], got {self.drift_margin}")
        if not 0.0 < self.coverage < 1.0:
            problems.append(f"serve.coverage must be in (0, 1), such as 0.9, got {self.coverage}")
        if not _DISCOVERY_PREFIX.fullmatch(self.discovery_prefix):
            problems.append(
                f"serve.discovery_prefix must be a topic without wildcards or empty levels, such as "
                f"'homeassistant', got {self.discovery_prefix!r}"
            )
        names = [r.name for r in self.alerts]
        if len(set(names)) != len(names):
            problems.append(f"serve.alerts: two rules share a name ({sorted(names)}); give each its own")
        for name, words in self.classes.items():
            if not isinstance(words, str) or not 0 < len(words.strip()) <= MAX_WORDS:
                problems.append(
                    f"serve.classes.{name} must be the class's meaning in 1 to {MAX_WORDS} characters, "
                    f'such as "worn horn and worn anvil", got {words!r}'
                )
        return problems

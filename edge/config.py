"""The device's configuration schema (``device.toml``; CLI flags override).

The reader (``ioft_protocol.config.build``) checks it and lists every failing field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ioft_protocol.codec import check_id
from ioft_protocol.mqtt_options import TlsConfig
from ioft_protocol.round_messages import MACHINE_KINDS
from ioft_protocol.secagg.config import MIN_PARTICIPANTS
from sensors.accel import adxl345, mpu6050
from sensors.files import DEFAULT_MAX_FILE_BYTES

#: Files ``device.toml`` may name relative to its own folder: ``(table, key)``.
RELATIVE_FILES = (
    ("tls", "ca_file"),
    ("tls", "cert_file"),
    ("tls", "key_file"),
    ("model", "public_key"),
    ("sensors", "schema"),  # a saved feature schema beside device.toml ("infer" is no path)
)


def resolve_relative_files(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """``raw`` with the relative paths of :data:`RELATIVE_FILES` joined to ``base`` (the TOML's folder).

    A device folder from ``cloud-aggregator fleet init`` names its certificate, key, CA
    and model key beside its ``device.toml``, so it works wherever it is copied.
    """
    out = dict(raw)
    for table, key in RELATIVE_FILES:
        section = out.get(table)
        value = section.get(key) if isinstance(section, dict) else None
        if isinstance(value, str) and value and value != "infer" and not Path(value).is_absolute():
            out[table] = {**section, key: str(base / value)}
    return out


@dataclass(frozen=True)
class DataConfig:
    """Where the device's local dataset comes from.

    ``source``: ``"simulate-printer"`` (seeded simulator), ``"simulate-welder"``,
    ``"simulate-printer-raw"`` (raw 2-axis vibration windows per layer, for ONNX
    encoders), or ``"state"`` (the dataset already in the state directory, e.g.
    filled by sensors).
    """

    source: str = "state"
    seed: int = 0
    train_speeds: int = 3
    max_rows: int = 100_000
    welder_group: str = "M"  # simulate-welder: FTL-TP domain group "M" (tool TC1-4) or "S" (New/Worn/DMGD)

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ValueError(f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        if self.welder_group not in ("M", "S"):
            raise ValueError(f"data.welder_group must be 'M' or 'S', got {self.welder_group!r}")


DATA_SOURCES = ("simulate-printer", "simulate-welder", "simulate-printer-raw", "state")


#: What ``[sensors]`` may name; see :class:`SensorsConfig`.
SENSOR_KINDS = MACHINE_KINDS
ACCEL_KINDS = ("adxl345", "mpu6050", "klipper")
CONTEXT_KINDS = ("moonraker",)
WELD_TARGETS = ("tool_m", "tool_s", "surface")
SPLIT_RULES = ("run", "layer", "weld")
#: The chips' own defaults and ranges (the drivers are the one place that knows them).
_CHIPS = {"adxl345": adxl345, "mpu6050": mpu6050}


@dataclass(frozen=True)
class SensorsConfig:
    """``[sensors]``: what ``edge-recorder`` reads to fill the device's local dataset.

    Printer (``kind = "printer"``): an accelerometer -- ``accel = "adxl345"`` or
    ``"mpu6050"`` on I2C bus ``i2c_bus`` (``/dev/i2c-<n>``) at ``address`` (default
    0x53 / 0x68), sampling at ``rate_hz`` in the ``range_g`` range; or
    ``accel = "klipper"``: Klipper owns the chip and streams it over its API socket
    ``klipper_socket`` (``klipper_chip`` = adxl345/mpu6050/mpu9250) -- and the printer
    context from Moonraker at ``moonraker_url`` polled every ``poll_s`` seconds.
    ``read_interval_s`` is how often the FIFO is drained (default: half the time the
    32-entry FIFO takes to fill, at most ``poll_s``).

    Welder (``kind = "welder"``): welds the monitoring system exports into
    ``weld_folder`` (a ``.done`` marker or ``settle_s`` of no change marks one complete),
    labelled from the operator/maintenance log ``label_log`` (.csv or .jsonl) for the
    task ``target`` (``tool_m``: TC1-TC4, ``tool_s``: New/Worn/DMGD, ``surface``).

    Split: ``split = "run"`` holds out whole print runs, ``"layer"`` single layers,
    ``"weld"`` single welds; a unit goes to test when the hash of its key falls below
    ``test_fraction`` (the rule is in :mod:`edge.recording`).  At most ``max_rows``
    rows are kept per split (the oldest go first); its default is 100,000 for a printer
    (4-byte rows) and 20,000 for a welder (624 features: every append rewrites the file,
    ~50 MB per split at that size).  ``max_file_bytes`` (default 32 MiB) caps a weld file: one
    larger on disk, or whose header declares more, is set aside in ``rejected/`` unread.

    A new sensor's welds (any channels, any rate): ``schema = "schema.json"`` names the feature
    schema ``edge-recorder schema --from FOLDER --save schema.json`` saved, or ``schema = "infer"``
    infers it from the recordings already in ``weld_folder`` at the first start (kept in the
    state folder, so it never changes under the dataset).  Unset: the default weld schema.
    ``min_sample_rate`` (Hz) is the lowest rate read (default: the schema's rate).
    """

    kind: str
    accel: str = "adxl345"
    i2c_bus: int = 1
    address: int | None = None
    rate_hz: float = 200.0
    range_g: int = 4
    klipper_socket: str = "/tmp/klippy_uds"
    klipper_chip: str = "adxl345"
    context: str = "moonraker"
    moonraker_url: str = "http://127.0.0.1:7125"
    moonraker_api_key: str | None = None
    moonraker_timeout_s: float = 1.0
    poll_s: float = 0.25
    read_interval_s: float | None = None
    weld_folder: str | None = None
    label_log: str | None = None
    target: str = "tool_m"
    settle_s: float = 2.0
    split: str | None = None
    test_fraction: float = 0.25
    max_rows: int | None = None
    max_pending_welds: int = 2000
    status_every_s: float = 10.0
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    schema: str | None = None
    min_sample_rate: float | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []

        def one_of(name: str, value: object, options: tuple) -> None:
            if value not in options:
                problems.append(f"sensors.{name} must be one of {list(options)}, got {value!r}")

        one_of("kind", self.kind, SENSOR_KINDS)
        one_of("accel", self.accel, ACCEL_KINDS)
        one_of("context", self.context, CONTEXT_KINDS)
        one_of("klipper_chip", self.klipper_chip, ("adxl345", "mpu6050", "mpu9250"))
        one_of("target", self.target, WELD_TARGETS)
        if self.split is not None:
            one_of("split", self.split, SPLIT_RULES)
            if self.kind == "welder" and self.split != "weld":
                problems.append(f"sensors.split for a welder must be 'weld', got {self.split!r}")
            if self.kind == "printer" and self.split == "weld":
                problems.append("sensors.split for a printer must be 'run' or 'layer', got 'weld'")
        if not 0 <= self.i2c_bus <= 255:
            problems.append(f"sensors.i2c_bus must be a bus number 0..255 (/dev/i2c-N), got {self.i2c_bus}")
        if self.address is not None and not 0x03 <= self.address <= 0x77:
            problems.append(f"sensors.address must be a 7-bit I2C address 0x03..0x77, got {self.address:#x}")
        if not (0 < self.rate_hz <= 8000):
            problems.append(f"sensors.rate_hz must be in (0, 8000], got {self.rate_hz}")
        ranges = sorted(_CHIPS.get(self.accel, adxl345).RANGES)
        if self.range_g not in ranges:
            problems.append(f"sensors.range_g must be one of {ranges}, got {self.range_g}")
        if not self.moonraker_url.startswith(("http://", "https://")):
            problems.append(
                f"sensors.moonraker_url must start with http:// or https://, got {self.moonraker_url!r}"
            )
        for name in ("poll_s", "moonraker_timeout_s", "status_every_s", "read_interval_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 3600:
                problems.append(f"sensors.{name} must be in (0, 3600] seconds, got {value}")
        if not self.max_file_bytes >= 1024:
            problems.append(f"sensors.max_file_bytes must be >= 1024, got {self.max_file_bytes}")
        if self.schema is not None and not self.schema.strip():
            problems.append(
                'sensors.schema must be a schema file (edge-recorder schema --save FILE) or "infer"'
            )
        if self.min_sample_rate is not None and not 0 < self.min_sample_rate <= 10_000_000:
            problems.append(f"sensors.min_sample_rate must be in (0, 1e7] Hz, got {self.min_sample_rate}")
        if not 0 <= self.settle_s <= 300:
            problems.append(f"sensors.settle_s must be in [0, 300] seconds, got {self.settle_s}")
        if not 0.0 <= self.test_fraction < 1.0:
            problems.append(f"sensors.test_fraction must be in [0, 1), got {self.test_fraction}")
        if (self.max_rows is not None and self.max_rows < 1) or self.max_pending_welds < 0:
            problems.append("sensors.max_rows must be >= 1 and sensors.max_pending_welds >= 0")
        if self.kind != "welder" and (self.schema is not None or self.min_sample_rate is not None):
            problems.append(
                "sensors.schema and sensors.min_sample_rate are for kind = 'welder' (a folder of recordings)"
            )
        if self.kind == "welder":
            for name in ("weld_folder", "label_log"):
                if not getattr(self, name):
                    problems.append(f"sensors.{name} is required for kind = 'welder'")
            if self.label_log and not self.label_log.lower().endswith((".csv", ".jsonl", ".ndjson")):
                problems.append(f"sensors.label_log must be a .csv or .jsonl file, got {self.label_log!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def i2c_address(self) -> int:
        """The configured address, or the chip's default (ADXL345 0x53, MPU-6050 0x68)."""
        return (
            self.address
            if self.address is not None
            else (_CHIPS[self.accel].ADDRESS if self.accel in _CHIPS else 0)
        )

    @property
    def row_limit(self) -> int:
        """``max_rows`` or its default for the kind of machine."""
        return self.max_rows if self.max_rows is not None else (20_000 if self.kind == "welder" else 100_000)

    @property
    def split_rule(self) -> str:
        """``split`` or its default: whole runs for a printer, single welds for a welder."""
        return self.split or ("weld" if self.kind == "welder" else "run")


@dataclass(frozen=True)
class ModelConfig:
    """ONNX models pushed by the fleet (``edge.models``); off unless ``public_key`` is set.

    Parameters
    ----------
    public_key
        The fleet's Ed25519 public key (PEM); models signed with any other key are refused.
    names
        Model names this device installs (empty: any).
    rollback_margin
        Refuse (roll back from) a new version whose holdout metric is lower than the
        active one's by more than this (accuracy or R², absolute).
    window_bytes
        Chunks in flight at once are bounded by this many bytes (memory bound of a transfer).
    max_model_bytes
        Larger models are refused before any chunk is fetched.
    transfer_timeout_s
        A transfer making no progress for this long is abandoned (and retried on the next offer).
    max_opset, max_ir_version
        What this device's onnxruntime runs; the defaults are onnxruntime 1.17's
        (opset 20, IR 9), the oldest the device extra admits.
    threads
        onnxruntime intra-op threads (set explicitly: the default oversubscribes small CPUs).
    """

    public_key: str | None = None
    names: list[str] = field(default_factory=list)
    rollback_margin: float = 0.05
    window_bytes: int = 1024 * 1024
    max_model_bytes: int = 64 * 1024 * 1024
    transfer_timeout_s: float = 300.0
    max_opset: int = 20
    max_ir_version: int = 9
    threads: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.rollback_margin <= 1.0:
            raise ValueError(f"rollback_margin must be in [0, 1], got {self.rollback_margin}")
        if self.window_bytes < 1 or self.max_model_bytes < 1 or self.threads < 1:
            raise ValueError("window_bytes, max_model_bytes and threads must be >= 1")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")


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
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class SimulateConfig:
    """``[simulate]``: a simulated machine's pace, for benchmarks and tests (``edge.buffered``).

    Each answer (a synchronous round's or a buffered job's) leaves ``update_s`` × a
    log-normal factor of σ ``jitter`` seconds after the announcement it trains from came;
    the device leaves the fleet (retained status offline, answering nothing, the job in
    progress lost) at ``leave_per_s`` per second and comes back after an exponential time
    of mean ``away_s``.  Draws are seeded by ``seed`` and the device id.  All 0 (the
    default, and on a real machine): answers leave at once and the device never leaves.
    """

    update_s: float = 0.0
    jitter: float = 0.0
    leave_per_s: float = 0.0
    away_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("update_s", "jitter", "leave_per_s", "away_s"):
            value = getattr(self, name)
            if not 0.0 <= value <= 3600.0:
                raise ValueError(f"simulate.{name} must be in [0, 3600], got {value}")
        if self.leave_per_s > 0 and self.away_s <= 0:
            raise ValueError("simulate.away_s must be > 0 when simulate.leave_per_s is")


@dataclass(frozen=True)
class DeviceConfig:
    """``edge-trainer`` settings (TOML; CLI flags override).

    ``kind`` (``"printer"`` or ``"welder"``) and ``tags`` say what machine this is; the
    device carries them in its retained status, and a task whose ``devices`` selection
    does not match them is refused at once.  ``kind`` defaults to ``[sensors] kind``,
    else to the simulated machine of ``[data] source`` (:attr:`machine_kind`).
    """

    device: str
    fleet: str = "default"
    broker: str = "mqtt://127.0.0.1:1883"
    state_dir: str = "/var/lib/ioft"
    allow_plaintext: bool = False
    username: str | None = None
    password: str | None = None
    tls: TlsConfig | None = None
    keepalive: int = 15
    #: The retained status after an answered round goes out at most this often (seconds; 0: after
    #: every round); a refusal, a model change or a pause goes out at once.
    round_status_s: float = 30.0
    #: While connected, the status goes out again after this many seconds without one (0: never):
    #: the aggregator's rounds wait only for devices heard live lately ([collect] liveness_s), so a
    #: retained "online" left behind by nothing that runs stalls no round.  One status (~1 KB) a period.
    heartbeat_s: float = 30.0
    #: Seconds connected without a word from the fleet's aggregator (no round announcement, no
    #: roll call) before the device says so: a wrong ``fleet =`` otherwise fails in silence.
    aggregator_quiet_s: float = 15.0
    max_payload_bytes: int = 64 * 1024 * 1024
    tasks: list[str] = field(default_factory=list)
    algorithms: list[str] = field(default_factory=list)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sensors: SensorsConfig | None = None  # [sensors]: read by edge-recorder only
    kind: str | None = None
    tags: list[str] = field(default_factory=list)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)  # [simulate]: benchmarks only
    #: The fewest devices (itself counted) whose SecAgg sum this device takes part in: it sends
    #: no masked input to a smaller round, whatever the aggregator's task says.
    secagg_min_participants: int = MIN_PARTICIPANTS
    #: Whether this device demands its SecAgg neighbours' keys signed by fleet certificates, whatever
    #: the task says (unset: when it holds a certificate, ``[tls] cert_file``); it signs its own then.
    secagg_signed_keys: bool | None = None
    serve: ServeConfig = field(default_factory=ServeConfig)  # [serve]: answers for every new row

    def __post_init__(self) -> None:
        check_id("device", self.device)
        if self.kind is not None and self.kind not in MACHINE_KINDS:
            raise ValueError(f"kind must be one of {list(MACHINE_KINDS)}, got {self.kind!r}")
        if self.kind is not None and self.sensors is not None and self.sensors.kind != self.kind:
            raise ValueError(
                f"kind = {self.kind!r} but [sensors] kind = {self.sensors.kind!r}; make them agree"
            )
        for tag in self.tags:
            check_id("tag", tag)
        check_id("fleet", self.fleet)
        if self.keepalive < 2:
            raise ValueError(f"keepalive must be >= 2 s, got {self.keepalive}")
        if not self.aggregator_quiet_s > 0:
            raise ValueError(f"aggregator_quiet_s must be > 0 s, got {self.aggregator_quiet_s}")
        if not self.round_status_s >= 0:
            raise ValueError(f"round_status_s must be >= 0 s, got {self.round_status_s}")
        if not self.heartbeat_s >= 0:
            raise ValueError(f"heartbeat_s must be >= 0 s (0: no heartbeat), got {self.heartbeat_s}")
        if self.secagg_min_participants < 2:
            raise ValueError(
                f"secagg_min_participants must be >= 2 (a sum of one is this device's update), "
                f"got {self.secagg_min_participants}"
            )
        advising = self.serve.tasks or self.tasks
        if self.serve.apply != "none" and self.serve.advice_task is None and len(advising) > 1:
            raise ValueError(
                f"serve.apply = {self.serve.apply!r} with several tasks ({', '.join(advising)}) needs "
                'serve.advice_task = "<task>": the one whose advice the printer takes'
            )
        if self.serve.advice_task is not None and advising and self.serve.advice_task not in advising:
            raise ValueError(
                f"serve.advice_task = {self.serve.advice_task!r} is not one of the tasks here ({', '.join(advising)})"
            )
        for rule in self.serve.alerts:  # a rule whose task never runs here would never fire
            if advising and rule.task not in advising:
                raise ValueError(
                    f"serve.alerts {rule.name!r}: task = {rule.task!r} is not one of the tasks here "
                    f"({', '.join(advising)}); name one of them or remove the rule"
                )
        if self.secagg_signed_keys and (self.tls is None or self.tls.cert_file is None):
            raise ValueError(
                "secagg_signed_keys = true needs this device's certificate: give [tls] ca_file, cert_file "
                "and key_file (`fleet init --auth certs` writes them), or leave secagg_signed_keys unset"
            )

    @property
    def demands_signed_secagg_keys(self) -> bool:
        """Whether this device demands signed SecAgg keys of its neighbours (see ``secagg_signed_keys``)."""
        if self.secagg_signed_keys is not None:
            return self.secagg_signed_keys
        return self.tls is not None and self.tls.cert_file is not None

    @property
    def machine_kind(self) -> str | None:
        """``kind``, else ``[sensors] kind``, else the simulated machine (``None``: undeclared)."""
        if self.kind is not None:
            return self.kind
        if self.sensors is not None:
            return self.sensors.kind
        simulated = self.data.source.removeprefix("simulate-").split("-")[0]
        return simulated if simulated in MACHINE_KINDS else None

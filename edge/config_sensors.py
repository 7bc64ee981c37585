"""``[sensors]`` of ``device.toml``: what ``edge-recorder`` reads (:class:`SensorsConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from ioft_protocol.round_messages import MACHINE_KINDS
from sensors.accel import adxl345, mpu6050
from sensors.files import DEFAULT_MAX_FILE_BYTES

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
        problems = self._choice_problems() + self._range_problems() + self._welder_problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _choice_problems(self) -> list[str]:
        """The fields that name one of a few options, and the split rule against the machine."""
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
        return problems

    def _range_problems(self) -> list[str]:
        """The values outside their range or form (numbers, the Moonraker URL, a blank schema)."""
        problems: list[str] = []
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
        return problems

    def _welder_problems(self) -> list[str]:
        """The welder's fields: required for a welder, refused for any other machine."""
        problems: list[str] = []
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
        return problems

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

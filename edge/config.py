"""The device's configuration schema (``device.toml``; CLI flags override).

The reader (``ioft_protocol.config.build``) checks it and lists every failing field.  The
``[sensors]`` section is :mod:`edge.config_sensors`, ``[serve]`` :mod:`edge.config_serve`; the
smaller sections and :class:`DeviceConfig`, which holds them all, are here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.config_sensors import SensorsConfig
from edge.config_serve import ServeConfig
from ioft_protocol.codec import check_id
from ioft_protocol.mqtt_options import TlsConfig
from ioft_protocol.round_messages import MACHINE_KINDS
from ioft_protocol.secagg.config import MIN_PARTICIPANTS

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

"""SecAgg settings (``[task.secagg]`` in the aggregator TOML) and what one round derives from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ioft_protocol.secagg.graph import default_degree

#: The fewest devices whose sum a SecAgg round reveals, by default (task and device alike).
MIN_PARTICIPANTS = 3


@dataclass(frozen=True)
class SecAggConfig:
    """How a task's uploads are masked.

    Parameters
    ----------
    threshold
        Shares needed to rebuild a device's seeds: a fraction of its share holders (its
        neighbours and itself) in (0.5, 1], or a count (>= 2).  Above one half, a server
        that tells different devices different stories about who dropped still cannot
        collect both seeds of one device.
    degree
        Neighbours per device on the random Harary graph; 0 picks ~2·log2(n).
    clip
        Each coordinate of the update (the change to the global parameters) is clipped to
        [-clip, clip] before fixed-point encoding.
    bits
        Fixed-point bits of one clipped coordinate (sign included); the step is
        clip / (2^(bits-1) - 1).
    max_weight
        Device weights are capped here and divided by it, so each lies in [0, 1].
    min_participants
        A round with fewer devices left at any stage is abandoned: the sum of one device is
        its update.  At least 2; devices also keep their own floor (``edge`` device.toml
        ``secagg_min_participants``, default :data:`MIN_PARTICIPANTS`) that no task lowers.
    signed_keys
        Every device signs its advertised keys with its certificate's key and checks its
        neighbours' against the fleet CA (``ioft_protocol.secagg.identity``); a device without
        a certificate refuses the task.  Unset: true where the aggregator logs in with a
        certificate (a ``fleet init --auth certs`` fleet).  A device holding a certificate
        checks its neighbours' keys whatever the task says (device.toml ``secagg_signed_keys``).
    """

    threshold: float = 0.67
    degree: int = 0
    clip: float = 1.0
    bits: int = 16
    max_weight: float = 1.0
    min_participants: int = MIN_PARTICIPANTS
    signed_keys: bool | None = None

    def __post_init__(self) -> None:
        errors = []
        if self.signed_keys is not None and not isinstance(self.signed_keys, bool):
            errors.append(f"signed_keys {self.signed_keys!r} must be true or false")
        t = self.threshold
        if not (0.5 < t <= 1 or (float(t).is_integer() and t >= 2)):
            errors.append(f"threshold {t} must be a fraction in (0.5, 1] or a share count >= 2")
        if self.degree < 0:
            errors.append(f"degree {self.degree} must be >= 0 (0 picks about 2·log2(devices))")
        if not (math.isfinite(self.clip) and self.clip > 0):
            errors.append(f"clip {self.clip} must be a positive number")
        if not 2 <= self.bits <= 31:
            errors.append(f"bits {self.bits} must be in 2..31")
        if not (math.isfinite(self.max_weight) and self.max_weight > 0):
            errors.append(f"max_weight {self.max_weight} must be a positive number")
        m = self.min_participants
        if not isinstance(m, int) or isinstance(m, bool) or m < 2:
            errors.append(f"min_participants {m!r} must be an integer >= 2 (a sum of one is that update)")
        if errors:
            raise ValueError("; ".join(errors))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "threshold": self.threshold,
            "degree": self.degree,
            "clip": self.clip,
            "bits": self.bits,
            "max_weight": self.max_weight,
        }
        if self.min_participants != MIN_PARTICIPANTS:  # left out at the default: specs stay as stored
            out["min_participants"] = self.min_participants
        if self.signed_keys is not None:
            out["signed_keys"] = self.signed_keys
        return out

    @classmethod
    def from_json(cls, value: Any) -> SecAggConfig:
        keys = [*cls().to_json(), "min_participants", "signed_keys"]
        if not isinstance(value, dict) or set(value) - set(keys):
            raise ValueError(f"secagg settings must be a table with keys {sorted(keys)}")
        return cls(**value)

    def round_params(self, n: int, length: int, *, certificates: bool = False, codes: int = 0) -> RoundParams:
        """The parameters of a round with ``n`` devices and ``length`` coordinates; ``certificates``:
        whether the fleet logs in with certificates (what an unset ``signed_keys`` follows);
        ``codes``: the devices send ``codes``-bit compressed integers (``ioft_protocol.compress``),
        not fixed-point floats, so the ring needs only ``codes + ceil(log2 n)`` bits."""
        degree = min(n - 1, self.degree) if self.degree else default_degree(n)
        degree += degree % 2 if degree < n - 1 else 0  # the Harary graph is built for even k
        holders = degree + 1
        t = math.ceil(self.threshold * holders) if self.threshold <= 1 else int(self.threshold)
        t = max(t, holders // 2 + 1)
        if t > holders:
            raise ValueError(
                f"threshold {self.threshold} needs {t} share holders but each device has {holders}; "
                "raise degree or lower threshold"
            )
        # n inputs sum without wrapping
        ring_bits = (codes or self.bits) + math.ceil(math.log2(max(n, 1)))
        if ring_bits > 64:
            raise ValueError(f"{n} devices with bits = {self.bits} need a {ring_bits}-bit ring; lower bits")
        signed = certificates if self.signed_keys is None else self.signed_keys
        return RoundParams(
            n,
            degree,
            t,
            ring_bits,
            self.clip,
            self.bits,
            self.max_weight,
            length,
            self.min_participants,
            signed,
            codes,
        )


@dataclass(frozen=True)
class RoundParams:
    """One round's numbers, sent to every device in the setup message."""

    n: int
    degree: int
    threshold: int
    ring_bits: int
    clip: float
    bits: int
    max_weight: float
    length: int  # coordinates of the update, the weight coordinate not counted
    min_participants: int = 2  # the task's; a device also applies its own floor
    signed_keys: bool = False  # devices sign their keys and check their neighbours'
    #: 0: fixed-point floats (``quantize``); 1, 2, 4, 8: compressed codes of that many bits, summed
    #: as unsigned integers (``ioft_protocol.compress.encode_ring``); left out of the wire form at 0
    codes: int = 0

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        if not self.codes:
            del out["codes"]
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> RoundParams:
        """Parameters from a setup message; ``ValueError`` naming the first bad field."""
        names = [f.name for f in fields(cls)]
        if not isinstance(value, dict) or sorted({"codes": 0, **value}) != sorted(names):
            raise ValueError(f"round parameters must have exactly {names} (codes optional)")
        for name in ("n", "degree", "threshold", "ring_bits", "bits", "length", "min_participants", "codes"):
            if name == "codes" and name not in value:
                continue
            v = value[name]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"round parameter {name} must be an integer >= 0, got {v!r}")
        if not isinstance(value["signed_keys"], bool):
            raise ValueError(
                f"round parameter signed_keys must be true or false, got {value['signed_keys']!r}"
            )
        for name in ("clip", "max_weight"):
            v = value[name]
            if not isinstance(v, int | float) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"round parameter {name} must be a positive number, got {v!r}")
        codes = value.get("codes", 0)
        if codes not in (0, 1, 2, 4, 8):
            raise ValueError(f"round parameter codes must be 0, 1, 2, 4 or 8, got {codes!r}")
        if not (1 <= value["ring_bits"] <= 64 and value["bits"] >= 2 and codes <= value["ring_bits"]):
            raise ValueError(f"round parameters need 2 <= bits, codes <= ring_bits <= 64, got {value}")
        if not codes and value["bits"] > value["ring_bits"]:
            raise ValueError(f"round parameters need bits <= ring_bits, got {value}")
        return cls(**value)

"""The aggregator's side of SecAgg+: a state machine over the four stages.

Feed it each device's answer with ``receive_*`` and close a stage with ``close_*`` (at a
deadline, or when everyone answered): devices that did not answer have dropped.  The
round ends in a :class:`SecAggResult` (the survivors' exact sum) or an
:class:`Abandoned` with a reason; ``ledger`` counts, per stage, who answered.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ioft_protocol.secagg import crypto, graph, identity, quantize, shamir
from ioft_protocol.secagg.client import pair_sign, pairwise_mask
from ioft_protocol.secagg.config import RoundParams, SecAggConfig
from ioft_protocol.secagg.messages import (
    AdvertiseKeys,
    Inbox,
    MaskedInput,
    NeighbourKeys,
    Setup,
    ShareKeys,
    UnmaskAnswer,
    UnmaskRequest,
)

STAGES = ("keys", "shares", "masked", "unmask")


class AbandonReason(enum.StrEnum):
    TOO_FEW_KEYS = "too_few_keys"  # too few devices advertised keys to hold each other's shares
    TOO_FEW_SHARES = "too_few_shares"
    TOO_FEW_INPUTS = "too_few_inputs"
    TOO_FEW_UNMASK = "too_few_unmask_answers"  # some seed has fewer than threshold shares
    BAD_SHARES = "bad_shares"  # rebuilt mask key does not match the advertised public key
    #: fewer devices than the task's min_participants at some stage: their sum would say too much
    TOO_FEW_PARTICIPANTS = "too_few_participants"


@dataclass(frozen=True)
class Abandoned:
    reason: AbandonReason
    detail: str
    ledger: dict[str, int]


@dataclass(frozen=True)
class SecAggResult:
    """``total`` = Σ w·clip(x) and ``weight`` = Σ w over ``survivors`` (quantized weights)."""

    total: np.ndarray
    weight: float
    survivors: tuple[str, ...]
    ledger: dict[str, int] = field(default_factory=dict)

    def mean(self) -> np.ndarray:
        if self.weight <= 0:
            raise ValueError("the survivors' weights sum to zero")
        return self.total / self.weight


class StageError(ValueError):
    """A message that does not belong to the stage or comes from a device not in it; it is dropped."""


class ServerSecAgg:
    """One SecAgg round on the aggregator."""

    def __init__(
        self,
        config: SecAggConfig,
        devices: Iterable[str],
        *,
        session: str,
        length: int,
        rng: random.Random | None = None,
        certificates: bool = False,
        codes: int = 0,
    ) -> None:
        self.devices = tuple(sorted(set(devices)))
        self.session = session
        self.params: RoundParams = config.round_params(
            len(self.devices), length, certificates=certificates, codes=codes
        )
        self.neighbours = graph.harary(self.devices, self.params.degree, rng or random.SystemRandom())
        self.stage = "setup"
        self.outcome: SecAggResult | Abandoned | None = None
        self.u1: dict[str, AdvertiseKeys] = {}
        self._shares: dict[str, ShareKeys] = {}
        self.u2: set[str] = set()
        self._masked: dict[str, bool] = {}  # who uploaded; the inputs are summed as they come
        self._masked_sum = np.zeros(self.params.length + 1, dtype=quantize.RING_DTYPE)
        self._answers: dict[str, UnmaskAnswer] = {}
        self.ledger = {"selected": len(self.devices), **{s: 0 for s in STAGES}}

    # -- stage 0 ------------------------------------------------------------------------------
    def setup(self) -> dict[str, Setup]:
        """Each device's setup request; none (and the round abandoned) when too few devices."""
        self._expect("setup", "keys")
        if self._too_few(len(self.devices), "devices ready"):
            return {}
        p = self.params.to_json()
        return {d: Setup(self.session, p, sorted(self.neighbours[d])) for d in self.devices}

    def receive_keys(self, device: str, msg: AdvertiseKeys) -> None:
        self._from(device, "keys", self.devices, self.u1)
        if len(msg.c_pk) != crypto.KEY_BYTES or len(msg.s_pk) != crypto.KEY_BYTES:
            raise StageError(f"{device}: public keys must be {crypto.KEY_BYTES} bytes")
        # relayed as they came: the neighbours check them (the server is not who they trust)
        if bool(msg.cert) != bool(msg.signature):
            raise StageError(f"{device}: a certificate and a signature come together, or neither")
        if len(msg.cert) > identity.MAX_CERT_BYTES or len(msg.signature) > identity.MAX_SIGNATURE_BYTES:
            raise StageError(
                f"{device}: certificate or signature too long (at most {identity.MAX_CERT_BYTES} and "
                f"{identity.MAX_SIGNATURE_BYTES} bytes)"
            )
        self.u1[device] = msg

    def close_keys(self) -> dict[str, NeighbourKeys]:
        self._expect("keys", "shares")
        self.ledger["keys"] = len(self.u1)
        # a device whose live neighbourhood cannot hold threshold shares is left out, which
        # may thin its neighbours' in turn: prune to a fixed point
        live = set(self.u1)
        while True:
            thin = {d for d in live if len(self.neighbours[d] & live) + 1 < self.params.threshold}
            if not thin:
                break
            live -= thin
        self._u1_live = live
        if live and self._too_few(len(live), "devices left after the key exchange"):
            return {}
        if not live:
            self._abandon(
                AbandonReason.TOO_FEW_KEYS, f"{len(self.u1)} of {len(self.devices)} advertised keys"
            )
            return {}
        return {
            d: NeighbourKeys({v: self._relayed(v) for v in sorted(self.neighbours[d] & live)})
            for d in sorted(live)
        }

    def _relayed(self, device: str) -> list[bytes]:
        keys = self.u1[device]
        return [keys.c_pk, keys.s_pk, *([keys.cert, keys.signature] if keys.cert else [])]

    # -- stage 1 ------------------------------------------------------------------------------
    def receive_shares(self, device: str, msg: ShareKeys) -> None:
        self._from(device, "shares", self._u1_live, self._shares)
        if set(msg.sealed) != self.neighbours[device] & self._u1_live:
            raise StageError(f"{device}: shares must go to exactly its neighbours that advertised keys")
        self._shares[device] = msg

    def close_shares(self) -> dict[str, Inbox]:
        self._expect("shares", "masked")
        self.u2 = set(self._shares)
        self.ledger["shares"] = len(self.u2)
        if len(self.u2) < self.params.threshold:
            self._abandon(AbandonReason.TOO_FEW_SHARES, f"{len(self.u2)} devices shared keys")
            return {}
        if self._too_few(len(self.u2), "devices shared keys"):
            return {}
        return {
            d: Inbox({v: self._shares[v].sealed[d] for v in sorted(self.neighbours[d] & self.u2)})
            for d in sorted(self.u2)
        }

    # -- stage 2 ------------------------------------------------------------------------------
    def receive_masked(self, device: str, msg: MaskedInput) -> None:
        self._from(device, "masked", self.u2, self._masked)
        if msg.ring_bits != self.params.ring_bits:
            raise StageError(
                f"{device}: ring of {msg.ring_bits} bits, the round uses {self.params.ring_bits}"
            )
        try:
            y = quantize.unpack(self.params, msg.y, self.params.length + 1)
        except ValueError as exc:
            raise StageError(f"{device}: {exc}") from None
        self._masked_sum += y  # streaming: memory O(length); reduced mod 2^r at the end
        self._masked[device] = True

    def close_masked(self) -> dict[str, UnmaskRequest]:
        self._expect("masked", "unmask")
        u3 = set(self._masked)
        self.ledger["masked"] = len(u3)
        short = self._short_of_holders(u3)
        if short:
            self._abandon(AbandonReason.TOO_FEW_INPUTS, short)
            return {}
        if self._too_few(len(u3), "masked inputs"):
            return {}
        self._requests = {
            d: UnmaskRequest(
                survivors=sorted((self.neighbours[d] & u3) | {d}),
                dropped=sorted(self.neighbours[d] & (self.u2 - u3)),
            )
            for d in sorted(u3)
        }
        return self._requests

    # -- stage 3 ------------------------------------------------------------------------------
    def receive_unmask(self, device: str, msg: UnmaskAnswer) -> None:
        self._from(device, "unmask", set(self._masked), self._answers)
        asked = self._requests[device]
        if sorted(msg.b_shares) != asked.survivors or sorted(msg.s_shares) != asked.dropped:
            raise StageError(f"{device}: the unmask answer does not match what was asked")
        if any(
            not isinstance(v, bytes) or len(v) != shamir.SHARE_BYTES
            for v in [*msg.b_shares.values(), *msg.s_shares.values()]
        ):
            raise StageError(f"{device}: a share is not {shamir.SHARE_BYTES} bytes")
        self._answers[device] = msg

    def close_unmask(self) -> SecAggResult | Abandoned:
        self._expect("unmask", "done")
        self.ledger["unmask"] = len(self._answers)
        u3 = set(self._masked)
        short = self._short_of_holders(set(self._answers))
        if short:
            return self._abandon(AbandonReason.TOO_FEW_UNMASK, short)
        p = self.params
        n = p.length + 1
        total = self._masked_sum.copy()
        try:
            b_seeds = {d: self._rebuild(d, "b") for d in sorted(u3)}
            s_keys = {d: self._rebuild(d, "s") for d in sorted(self.u2 - u3)}
        except ValueError as exc:
            return self._abandon(AbandonReason.BAD_SHARES, str(exc))
        for d in sorted(u3):
            total -= quantize.prg(p, b_seeds[d], n)
        for d, s_sk in s_keys.items():
            keys = crypto.KeyPair(s_sk)
            if keys.public != self.u1[d].s_pk:
                return self._abandon(
                    AbandonReason.BAD_SHARES, f"{d}'s rebuilt mask key is not the one it advertised"
                )
            for u in sorted(self.neighbours[d] & u3):
                m = pairwise_mask(keys, self.u1[u].s_pk, self.session, p, n)
                # u added sign(u, d)·m; take it back out
                total = total - m if pair_sign(u, d) > 0 else total + m
        values, weight = quantize.decode_sum(p, total)
        self.outcome = SecAggResult(values, weight, tuple(sorted(u3)), dict(self.ledger))
        return self.outcome

    # -- helpers ------------------------------------------------------------------------------
    def _rebuild(self, owner: str, which: str) -> bytes:
        holders = sorted((self.neighbours[owner] | {owner}) & set(self._answers))
        got = [getattr(self._answers[h], f"{which}_shares").get(owner) for h in holders]
        shares = [s for s in got if s is not None]
        if len(shares) < self.params.threshold:
            raise ValueError(f"{owner}: {len(shares)} shares, threshold is {self.params.threshold}")
        return shamir.combine(shares[: self.params.threshold])

    def _short_of_holders(self, answering: set[str]) -> str:
        """Why some needed seed would have fewer than threshold holders among ``answering``; '' if none."""
        t = self.params.threshold
        u3 = set(self._masked)
        for d in sorted(self.u2):
            have = len((self.neighbours[d] | {d}) & self.u2 & answering)
            if have < t:
                what = "self-mask seed" if d in u3 else "mask key"
                return f"{d}'s {what} has {have} share holders answering, threshold is {t}"
        return ""

    def _too_few(self, count: int, what: str) -> bool:
        """Abandon (and say so) when ``count`` is below the task's ``min_participants``."""
        if count >= self.params.min_participants:
            return False
        self._abandon(
            AbandonReason.TOO_FEW_PARTICIPANTS,
            f"{count} {what}, min_participants is {self.params.min_participants}",
        )
        return True

    def _abandon(self, reason: AbandonReason, detail: str) -> Abandoned:
        self.stage = "abandoned"
        self.outcome = Abandoned(reason, detail, dict(self.ledger))
        return self.outcome

    def _expect(self, stage: str, nxt: str) -> None:
        if self.stage != stage:
            raise StageError(f"cannot move to {nxt!r} from stage {self.stage!r}")
        self.stage = nxt

    def _from(self, device: str, stage: str, allowed: Iterable[str], seen: dict) -> None:
        if self.stage != stage:
            raise StageError(f"{device}: a {stage!r} message while at stage {self.stage!r}")
        if device not in allowed:
            raise StageError(f"{device}: not in this stage of the round")
        if device in seen:
            raise StageError(f"{device}: answered this stage twice")

"""The device's side of SecAgg+: a state machine that answers the server's four requests.

What keeps a live device private against a server that lies about who dropped: the
device answers one unmask request per round, refuses one that names a device both
survived and dropped (or names itself dropped), and gives each neighbour's self-mask
share or its mask-key share, never both.  With a threshold above half the share holders,
no split of stories across devices collects both seeds of one device.

Against a server that substitutes a neighbour's keys (to receive the shares sealed to that
neighbour, or to agree its pairwise mask): with signed keys, the device signs its own
advertisement and checks each neighbour's certificate and signature before deriving anything
from its keys (``identity``).  Any refusal after a stage began ends the session: the device
answers nothing more in it (Bonawitz et al.'s clients abort).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ioft_protocol.secagg import crypto, identity, quantize, shamir
from ioft_protocol.secagg.config import MIN_PARTICIPANTS, RoundParams
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

_SHARE_INFO = b"ioft-secagg share key"
_MASK_INFO = b"ioft-secagg pairwise mask"


class SecAggRefusedError(ValueError):
    """The device will not go on with this round; the message says why (sent as its status)."""


_Stage = TypeVar("_Stage", bound=Callable)


def _aborts(stage: _Stage) -> _Stage:
    """A refusal once the stage has begun ends the session (a request at the wrong stage, e.g. a
    broker's duplicate delivery, is refused without ending it)."""

    @functools.wraps(stage)
    def run(self: ClientSecAgg, *args: Any, **kwargs: Any) -> Any:
        before = self.stage
        try:
            return stage(self, *args, **kwargs)
        except SecAggRefusedError:
            if self.stage != before:
                self.stage = "aborted"
            raise

    return run  # type: ignore[return-value]


def pair_sign(me: str, other: str) -> int:
    """+1 if ``me`` adds the pairwise mask with ``other``, -1 if it subtracts it."""
    return 1 if me < other else -1


def _aad(session: str, sender: str, recipient: str) -> bytes:
    return f"{session}\x00{sender}\x00{recipient}".encode()


def pairwise_mask(
    keys: crypto.KeyPair, peer_s_pk: bytes, session: str, p: RoundParams, length: int
) -> np.ndarray:
    """The mask two devices agree on (X25519 + HKDF, salted with the session), as a ring vector."""
    seed = keys.agree(peer_s_pk, salt=session.encode(), info=_MASK_INFO)
    return quantize.prg(p, seed, length)


class ClientSecAgg:
    """One device in one SecAgg round.  Call the stage methods in order; each returns the answer.

    ``min_participants`` is the device's own floor: whatever the server's parameters say, it
    goes on only while at least this many devices (itself counted) share its round: fewer,
    and the sum the server learns says too much about this device's update.

    ``signer`` (this device's certificate and key) signs its advertised keys; ``trust`` (the
    fleet CA) checks its neighbours'.  Neighbours' keys must be signed when the round's
    ``signed_keys`` says so or ``require_signed`` does (the device's own floor, which the
    server cannot lower).  ``scope`` names what the keys are for beyond the session (fleet,
    task, round, phase): a signature for one scope is refused in another.
    """

    def __init__(
        self,
        device: str,
        *,
        min_participants: int = MIN_PARTICIPANTS,
        signer: identity.KeySigner | None = None,
        trust: identity.FleetTrust | None = None,
        require_signed: bool = False,
        scope: str = "",
    ) -> None:
        self.device = device
        self.stage = "new"
        self.floor = min_participants
        self.signer = signer
        self.trust = trust
        self.require_signed = require_signed
        self.signed = require_signed  # this round's: setup adds what the server's parameters say
        self.scope = scope

    def _enter(self, expected: str, nxt: str) -> None:
        if self.stage != expected:
            raise SecAggRefusedError(f"{self.device}: got a {nxt!r} request while at stage {self.stage!r}")
        self.stage = nxt

    @_aborts
    def setup(self, msg: Setup) -> AdvertiseKeys:
        self._enter("new", "keys")
        self.session = msg.session
        try:
            self.params: RoundParams = msg.round_params
        except (TypeError, ValueError) as exc:
            raise SecAggRefusedError(f"{self.device}: bad round parameters: {exc}") from None
        self.neighbours = frozenset(msg.neighbours) - {self.device}
        self.min_participants = max(self.floor, self.params.min_participants)
        self._enough(len(self.neighbours) + 1, "devices in its neighbourhood")
        holders, t = len(self.neighbours) + 1, self.params.threshold
        if not holders / 2 < t <= holders:
            # at or below half, a server telling two stories about one device could collect both its seeds
            raise SecAggRefusedError(
                f"{self.device}: threshold {t} must be above half of its {holders} share holders, at most all"
            )
        self.signed = self.require_signed or self.params.signed_keys
        if self.signed and (self.signer is None or self.trust is None):
            raise SecAggRefusedError(
                f"{self.device}: the round needs signed SecAgg keys but this device has no certificate "
                "(device.toml [tls] cert_file, key_file, ca_file; `fleet init --auth certs`), or the task "
                "must set [task.secagg] signed_keys = false"
            )
        self._c = crypto.KeyPair()
        self._s = crypto.KeyPair()
        if self.signer is None:
            return AdvertiseKeys(c_pk=self._c.public, s_pk=self._s.public)
        signed = identity.binding(self.scope, self.session, self.device, self._c.public, self._s.public)
        return AdvertiseKeys(self._c.public, self._s.public, self.signer.cert_der, self.signer.sign(signed))

    @_aborts
    def share_keys(self, msg: NeighbourKeys) -> ShareKeys:
        self._enter("keys", "shares")
        extra = set(msg.keys) - self.neighbours
        if extra:
            raise SecAggRefusedError(
                f"{self.device}: keys for devices that are not neighbours: {sorted(extra)}"
            )
        if any(
            len(k) not in (2, 4) or {len(k[0]), len(k[1])} != {crypto.KEY_BYTES} for k in msg.keys.values()
        ):
            raise SecAggRefusedError(f"{self.device}: each neighbour needs two {crypto.KEY_BYTES}-byte keys")
        if self.signed:
            for v, k in sorted(msg.keys.items()):
                self._check_binding(v, k)
        self._peer_keys = {v: (bytes(k[0]), bytes(k[1])) for v, k in msg.keys.items()}
        holders = sorted([*self._peer_keys, self.device])
        t = self.params.threshold
        if len(holders) < t:
            raise SecAggRefusedError(f"{self.device}: {len(holders)} share holders left, threshold is {t}")
        self._enough(len(holders), "devices sent keys")
        points = {h: i + 1 for i, h in enumerate(holders)}
        self._b = crypto.random_seed()
        s_sh = shamir.split(self._s.secret, list(points.values()), t)
        b_sh = shamir.split(self._b, list(points.values()), t)
        # what I hold of each owner's seeds (mine now, the others' from the inbox)
        self._held = {self.device: (b_sh[points[self.device]], s_sh[points[self.device]])}
        sealed = {}
        for v in self._peer_keys:
            key = self._c.agree(self._peer_keys[v][0], salt=self.session.encode(), info=_SHARE_INFO)
            plain = b_sh[points[v]] + s_sh[points[v]]
            sealed[v] = crypto.seal(key, plain, _aad(self.session, self.device, v))
        return ShareKeys(sealed=sealed)

    def _check_binding(self, neighbour: str, keys: list[bytes]) -> None:
        """Refuse the round unless ``neighbour``'s keys carry its valid signature (before any use)."""
        if self.trust is None:  # setup refuses a signed round without it; kept for direct callers
            raise SecAggRefusedError(f"{self.device}: no fleet CA to check {neighbour}'s keys against")
        cert, signature = (bytes(keys[2]), bytes(keys[3])) if len(keys) == 4 else (b"", b"")
        signed = identity.binding(self.scope, self.session, neighbour, bytes(keys[0]), bytes(keys[1]))
        try:
            self.trust.check(neighbour, signed, cert, signature)
        except identity.KeyBindingError as exc:
            raise SecAggRefusedError(
                f"{self.device}: refused the SecAgg keys of {neighbour}: {exc}; it takes no part in this round"
            ) from None

    @_aborts
    def masked_input(self, msg: Inbox, update: np.ndarray, weight: float) -> MaskedInput:
        self._enter("shares", "masked")
        p = self.params
        for v, ct in msg.sealed.items():
            if v not in self._peer_keys:
                raise SecAggRefusedError(f"{self.device}: a share from {v!r}, which sent no keys")
            key = self._c.agree(self._peer_keys[v][0], salt=self.session.encode(), info=_SHARE_INFO)
            plain = crypto.open_sealed(key, bytes(ct), _aad(self.session, v, self.device))
            if plain is None or len(plain) != 2 * shamir.SHARE_BYTES:
                raise SecAggRefusedError(f"{self.device}: the share from {v!r} does not open")
            self._held[v] = (plain[: shamir.SHARE_BYTES], plain[shamir.SHARE_BYTES :])
        if len(self._held) < p.threshold:
            # with fewer pairwise masks, a server that withheld shares could unmask this device
            raise SecAggRefusedError(
                f"{self.device}: shares from {len(self._held) - 1} neighbours, threshold is {p.threshold}"
            )
        self._enough(len(self._held), "devices shared with it")
        n = p.length + 1
        y = quantize.encode(p, update, weight) + quantize.prg(p, self._b, n)
        for v in self._held:
            if v == self.device:
                continue
            m = pairwise_mask(self._s, self._peer_keys[v][1], self.session, p, n)
            y = y + m if pair_sign(self.device, v) > 0 else y - m  # uint64 wraps mod 2^64, a multiple of 2^r
        return MaskedInput(ring_bits=p.ring_bits, y=quantize.pack(p, y))

    @_aborts
    def unmask(self, msg: UnmaskRequest) -> UnmaskAnswer:
        self._enter("masked", "done")
        alive, gone = set(msg.survivors), set(msg.dropped)
        if alive & gone:
            raise SecAggRefusedError(f"{self.device}: told {sorted(alive & gone)} both survived and dropped")
        if self.device in gone or self.device not in alive:
            raise SecAggRefusedError(f"{self.device}: told it dropped, but it is here")
        unknown = (alive | gone) - set(self._held)
        if unknown:
            raise SecAggRefusedError(
                f"{self.device}: asked about {sorted(unknown)}, which shared no keys with it"
            )
        if len(alive) < self.params.threshold:
            raise SecAggRefusedError(
                f"{self.device}: {len(alive)} survivors in its neighbourhood, "
                f"fewer than the threshold {self.params.threshold}"
            )
        self._enough(len(alive), "survivors in its neighbourhood")
        return UnmaskAnswer(
            b_shares={v: self._held[v][0] for v in sorted(alive)},
            s_shares={v: self._held[v][1] for v in sorted(gone)},
        )

    def _enough(self, count: int, what: str) -> None:
        if count < self.min_participants:
            raise SecAggRefusedError(
                f"{self.device}: {count} {what}, fewer than its minimum of {self.min_participants} "
                "participants: it sends no masked input to so small a sum"
            )

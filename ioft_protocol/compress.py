"""Compressed uplinks: EDEN-style rotated quantization of a device's change ``u − g``.

The estimator (Vargaftik et al., "EDEN", ICML 2022; its 1-bit case is DRIVE, NeurIPS 2021):

1. ``x = u − g`` over all shared tensors, flattened in sorted name order (float32), cut into
   blocks of ``block`` = 2^k coordinates (the last one zero-padded; an update smaller than a
   block is one block of the next power of two, :func:`block_size`).
2. Rotation (``rotation = true``): each block is multiplied by random signs and by the
   orthonormal Walsh–Hadamard matrix, ``z = H D x / √B``.  The signs come from a seed every
   party derives from ``(task, round, phase, device, global_hash)``
   (:func:`derive_seed`), so the aggregator inverts the rotation with nothing sent for it.
3. Each block is normalized to unit RMS, ``ẑ = z · √B / ‖z‖``, and every coordinate is
   rounded to the nearest of ``2^bits`` levels of N(0, 1) (:func:`~ioft_protocol.quantize.centroids`:
   Lloyd–Max up to 4 bits, as EDEN; companding levels at 8), deterministically (by a table,
   :func:`~ioft_protocol.quantize.nearest_levels`), packed ``bits`` to a coordinate.
4. One float32 scale per block, ``S = ‖z‖² / ⟨z, q⟩`` (EDEN's unbiasing scale); the decoder
   returns ``x̂ = D Hᵀ (S q) / √B`` per block.

Unbiasedness, exactly: ``E[x̂] = x`` holds over a *uniformly random* rotation (EDEN's Theorem);
the randomized Hadamard rotation used here is the papers' practical stand-in, for which it
holds approximately (the bias is far below the estimator's own variance for the update
vectors of a trained network; ``benchmarks/compress_uplink.py --quick`` measures both).  Given
the rotation, the quantization is deterministic, hence not unbiased on its own.  Without the
rotation (``rotation = false``) the same scale is used on the raw coordinates, which are far
from Gaussian: it is biased and only there for comparison.

Bytes per coordinate: ``bits / 8`` plus ``4 / block`` for the scales (plus the padding); at 1 bit and B = 1024
that is ~1/31 of float32's 4 bytes.

Examples
--------
Four coordinates at 8 bits: four code bytes and one scale; :func:`decode` with the same seed
gives the change back to within the quantization error.

>>> import numpy as np
>>> sent = {"w": np.zeros(4, np.float32)}
>>> params = {"w": np.array([0.5, -1.0, 2.0, 0.25], np.float32)}
>>> config = CompressConfig(bits=8)
>>> wire = encode(params, sent, config, seed=7)
>>> {name: (a.dtype.name, a.shape) for name, a in wire.items()}
{'compress.codes': ('uint8', (4,)), 'compress.scales': ('float32', (1,))}
>>> back = decode(wire, sent, {"w": "float32"}, config, seed=7)
>>> print(back["w"].round(2))
[ 0.49 -1.    2.    0.26]
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ioft_protocol.quantize import (
    CELLS,
    SPAN,
    centroids,
    flip_signs,
    hadamard_rows,
    nearest_levels,
    pack,
    unpack,
)
from ioft_protocol.quantize import fwht as fwht  # the transform's reference, for callers of compress.fwht

#: Bits per coordinate a task may choose.
BITS = (1, 2, 4, 8)
#: Names of the two arrays a compressed upload carries in place of the parameters.
CODES, SCALES = "compress.codes", "compress.scales"


class CompressError(ValueError):
    """A compressed upload that cannot be decoded against the round's tensors."""


@dataclass(frozen=True)
class CompressConfig:
    """``[task.compress]``: ``bits`` per coordinate (1, 2, 4 or 8), the Hadamard ``rotation``
    (default on; off is biased) and the rotation's ``block`` (a power of two, 64 … 65536);
    ``downlink`` (2, 4 or 8; ``None``: float32) is the bits of the global sent down
    (:mod:`ioft_protocol.downlink`)."""

    bits: int = 1
    rotation: bool = True
    block: int = 1024
    downlink: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in BITS or isinstance(self.bits, bool):
            raise ValueError(f"compress.bits must be one of {list(BITS)}, got {self.bits!r}")
        if not isinstance(self.rotation, bool):
            raise ValueError(f"compress.rotation must be true or false, got {self.rotation!r}")
        b = self.block
        if isinstance(b, bool) or not isinstance(b, int) or b < 64 or b > 65536 or b & (b - 1):
            raise ValueError(f"compress.block must be a power of two in [64, 65536], got {b!r}")
        d = self.downlink
        if d is not None and (isinstance(d, bool) or d not in (2, 4, 8)):
            raise ValueError(f"compress.downlink must be 2, 4 or 8 (bits of the global), got {d!r}")

    def to_json(self) -> dict[str, Any]:
        # no "downlink" key when unset: the spec JSON (and its hash) of an uplink-only task is unchanged
        down = {} if self.downlink is None else {"downlink": self.downlink}
        return {"bits": self.bits, "rotation": self.rotation, "block": self.block, **down}

    @classmethod
    def from_json(cls, value: Any) -> CompressConfig:
        if not isinstance(value, dict) or set(value) - {"bits", "rotation", "block", "downlink"}:
            raise ValueError(f"compress must be a table of bits, rotation, block, downlink; got {value!r}")
        return cls(**value)


def derive_seed(task: str, round_: int, phase: str, device: str, global_hash: str) -> int:
    """The upload's 64-bit seed: device and aggregator derive the same from the round's fields.

    The global's hash makes it new for every global a device trains from; the fleet id is left
    out so that the in-process simulator (fleet ``"sim"``) draws what a real fleet draws.
    """
    text = f"ioft-compress|{task}|{round_}|{phase}|{device}|{global_hash}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _coded(names: Mapping[str, Any], sent: Mapping[str, np.ndarray]) -> list[str]:
    """The names whose change is coded: those of ``names`` the downlink holds, sorted."""
    return sorted(n for n in names if n in sent)


def block_size(config: CompressConfig, total: int) -> int:
    """The rotation's block for ``total`` coordinates: ``config.block``, or the power of two
    that holds them all when fewer (a 2-parameter model is not padded to 1024).

    Examples
    --------
    >>> block_size(CompressConfig(block=1024), 5), block_size(CompressConfig(block=1024), 150_000)
    (8, 1024)
    """
    return min(config.block, 1 << max(0, total - 1).bit_length())


def encode(
    params: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray], config: CompressConfig, seed: int
) -> dict[str, np.ndarray]:
    """``params − sent`` compressed: ``{CODES: uint8, SCALES: float32}`` (see the module docstring),
    over the names the downlink holds; an uploaded tensor it does not hold (a count, a curvature
    statistic: not a change of anything sent) travels as it is beside them.

    Raises ``ValueError`` when a name of both differs in shape.
    """
    names = _coded(params, sent)
    parts = []
    for n in names:
        u, g = np.asarray(params[n]), np.asarray(sent[n])
        if u.shape != g.shape:
            raise ValueError(f"{n!r} has shape {u.shape}, the downlink {g.shape}")
        parts.append(np.subtract(u, g, dtype=np.float32).ravel())
    x = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    bsize = block_size(config, x.size)
    nb = max(1, -(-x.size // bsize))
    blocks = np.zeros(nb * bsize, dtype=np.float32)
    blocks[: x.size] = x
    z = blocks.reshape(nb, bsize)
    if config.rotation:
        flip_signs(z, seed)
        z = hadamard_rows(z)
        z *= np.float32(1.0 / np.sqrt(bsize))
    sq = np.einsum("ij,ij->i", z, z, dtype=np.float64)
    c = centroids(config.bits)
    if config.bits == 1:  # the nearest of ±c₁ is the sign: no normalizing, no search
        idx = (z > 0).reshape(-1).view(np.uint8)
        dot = float(c[1]) * np.abs(z).sum(axis=1, dtype=np.float64)
    else:
        # Nearest level by table: ẑ on a grid of CELLS cells over ±SPAN, each cell mapped to the
        # level nearest its centre (a searchsorted over 255 boundaries cost ~9 ms for P = 150k).
        eta = np.where(sq > 0, np.sqrt(bsize / np.where(sq > 0, sq, 1.0)), 0.0)
        t = z * (eta * (CELLS / (2 * SPAN))).astype(np.float32)[:, None]
        t += np.float32(CELLS / 2)
        np.clip(t, 0, CELLS - 1, out=t)
        idx = nearest_levels(config.bits)[t.astype(np.int32).ravel()]
        dot = np.einsum("ij,ij->i", z, c[idx].reshape(nb, bsize), dtype=np.float64)
    scale = np.where(dot > 0, sq / np.where(dot > 0, dot, 1.0), 0.0).astype(np.float32)
    extras = {n: params[n] for n in params if n not in sent}
    return {CODES: pack(idx, config.bits), SCALES: scale, **extras}


def decode(
    arrays: Mapping[str, np.ndarray],
    sent: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str],
    config: CompressConfig,
    seed: int,
) -> dict[str, np.ndarray]:
    """The parameters ``sent + x̂`` an :func:`encode` output stands for, each in ``dtypes[name]``
    (the round's tensors: those ``sent`` holds are decoded, the others taken as they came).

    Raises
    ------
    CompressError
        Naming what is missing or of the wrong size.
    """
    names = _coded(dtypes, sent)
    extras = sorted(set(dtypes) - set(names))
    if set(arrays) != {CODES, SCALES, *extras}:
        raise CompressError(f"a compressed upload carries {[CODES, SCALES, *extras]}, got {sorted(arrays)}")
    codes, scale = np.asarray(arrays[CODES]), np.asarray(arrays[SCALES])
    sizes = [int(np.size(sent[n])) for n in names]
    total = sum(sizes)
    bsize = block_size(config, total)
    nb = max(1, -(-total // bsize))
    want = -(-nb * bsize * config.bits // 8)
    if codes.dtype != np.uint8 or codes.shape != (want,):
        raise CompressError(f"{CODES} must be uint8[{want}], got {codes.dtype}{list(codes.shape)}")
    if scale.dtype != np.float32 or scale.shape != (nb,):
        raise CompressError(f"{SCALES} must be float32[{nb}], got {scale.dtype}{list(scale.shape)}")
    if not np.isfinite(scale).all():
        raise CompressError(f"{SCALES} holds NaN or Inf")
    idx = unpack(codes, config.bits, nb * bsize)
    z = centroids(config.bits)[idx].reshape(nb, bsize)
    z *= scale[:, None]
    if config.rotation:
        z = hadamard_rows(z)  # H is symmetric and H·H = B·I: the inverse is H / B, split as two √B
        z *= np.float32(1.0 / np.sqrt(bsize))
        flip_signs(z, seed)
    flat = z.reshape(-1)
    out, at = {}, 0
    for n, size in zip(names, sizes, strict=True):
        g = np.asarray(sent[n])
        out[n] = np.add(g, flat[at : at + size].reshape(g.shape), dtype=np.float64).astype(dtypes[n])
        at += size
    return out | {n: arrays[n] for n in extras}


def wire_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Bytes the compressed arrays occupy (the payload adds a header of ~200 bytes)."""
    return sum(int(np.asarray(a).nbytes) for a in arrays.values())


def encode_upload(
    params: Mapping[str, np.ndarray],
    sent: Mapping[str, np.ndarray],
    how: Mapping[str, Any] | None,
    *,
    task: str,
    round_: int,
    phase: str,
    device: str,
    global_hash: str,
) -> dict[str, np.ndarray]:
    """What a device uploads for a task compressed as ``how`` (the spec's ``compress`` table;
    ``None``: ``params`` as they are): one function for the daemon and the simulator, so both
    send the same bytes.  ``sent`` is the downlink the device trained from."""
    if how is None:
        return dict(params)
    seed = derive_seed(task, round_, phase, device, global_hash)
    return encode(params, sent, CompressConfig.from_json(dict(how)), seed)


# -- composed with SecAgg: integer codes the masked ring can sum ---------------------------------
#
# SecAgg reveals only the sum of the devices' ring vectors, so the aggregator can invert neither
# a per-device rotation nor a per-device scale.  Under SecAgg every device therefore rotates with
# the round's shared seed (:func:`shared_seed`) and quantizes on one grid the whole round shares:
# ``2^bits`` evenly spaced levels over ``[-clip, clip]`` (``clip``: the task's ``[task.secagg]``
# clip, a bound on each *rotated* coordinate), with stochastic rounding, unbiased wherever the
# coordinate lies within the clip.  The codes are integers in ``[0, 2^bits - 1]``: their ring sum
# over the survivors is exactly the sum the aggregator would get from the codes in the clear, and
# decodes (:func:`decode_ring`) to the survivors' mean change.  EDEN's per-block scale and Lloyd–Max
# levels do not survive the sum, hence this uniform grid; the ring is ``bits + ceil(log2 n)`` bits.


def shared_seed(task: str, round_: int, phase: str, global_hash: str) -> int:
    """The rotation seed every device of a SecAgg round uses (no device in it: the sum is inverted once)."""
    return derive_seed(task, round_, phase, "", global_hash)


def ring_length(config: CompressConfig, total: int) -> int:
    """Coordinates of the ring vector for ``total`` parameters: whole rotation blocks."""
    bsize = block_size(config, total)
    return max(1, -(-total // bsize)) * bsize


def _rotate(z: np.ndarray, config: CompressConfig, seed: int, inverse: bool) -> np.ndarray:
    bsize = z.shape[1]
    if not config.rotation:
        return z
    if not inverse:
        flip_signs(z, seed)
    z = hadamard_rows(z)
    z *= np.float32(1.0 / np.sqrt(bsize))
    if inverse:
        flip_signs(z, seed)
    return z


def encode_ring(x: np.ndarray, config: CompressConfig, clip: float, seed: int, dither: int) -> np.ndarray:
    """The change ``x`` (flat, sorted-name order) as integer codes in ``[0, 2^bits - 1]`` (uint64,
    :func:`ring_length` of them): rotated with the round's ``seed``, clipped to ``±clip`` and rounded
    stochastically (``dither`` seeds the rounding: the device's own, a re-send is the same codes)."""
    x = np.asarray(x, dtype=np.float32).ravel()
    if not np.isfinite(x).all():
        raise ValueError("update holds NaN or Inf")
    length = ring_length(config, x.size)
    bsize = block_size(config, x.size)
    blocks = np.zeros(length, dtype=np.float32)
    blocks[: x.size] = x
    z = _rotate(blocks.reshape(-1, bsize), config, seed, inverse=False).reshape(-1)
    top = (1 << config.bits) - 1
    t = (np.clip(z.astype(np.float64), -clip, clip) + clip) * (top / (2 * clip))
    t += np.random.Generator(np.random.PCG64(dither)).random(t.size)
    return np.clip(np.floor(t), 0, top).astype(np.uint64)


def decode_ring(
    total: np.ndarray, count: int, config: CompressConfig, clip: float, seed: int, size: int
) -> np.ndarray:
    """The survivors' mean change (float64, ``size`` coordinates) from the exact sum of ``count``
    devices' :func:`encode_ring` codes: each code ``k`` stands for ``clip·(2k/(2^bits - 1) - 1)``."""
    if count <= 0:
        raise ValueError("no device's codes are in the sum")
    top = (1 << config.bits) - 1
    total = np.asarray(total, dtype=np.float64).ravel()
    if total.size != ring_length(config, size):
        raise ValueError(
            f"a ring sum of {total.size} codes; {size} parameters need {ring_length(config, size)}"
        )
    z = ((2.0 * total - count * top) * (clip / (top * count))).astype(np.float32)
    bsize = block_size(config, size)
    z = _rotate(z.reshape(-1, bsize), config, seed, inverse=True).reshape(-1)
    return z[:size].astype(np.float64)

"""Compressed downlinks (``[task.compress] downlink = 8 | 4 | 2``): the global goes down as codes.

The same estimator as the uplink (:mod:`ioft_protocol.compress`: randomized Hadamard rotation
per block, Lloyd–Max or companding levels, one float32 scale per block), applied to the global
itself (against zeros), so that a device needs nothing but the announcement to decode it: a
joiner, a device back from a week offline and a restated announcement decode it from that alone.

Bit for bit in step: the aggregator quantizes its global at the start of every phase and then
*runs the phase on the decoded global* (``cloud_aggregator.rounds.engine``): that is what the
simulator's clients train from, what a device decodes from the announcement
(:meth:`ioft_protocol.round_messages.Announcement.decode` calls :func:`decode_global`), and what
the uploads' changes are taken against.  The rotation's seed derives from the task, round and
phase only (:func:`downlink_seed`), so a restarted aggregator re-quantizes its stored global to
the same codes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ioft_protocol.compress import CompressConfig, CompressError, decode, derive_seed, encode

#: Bits a task may send its global in (1 bit of a weight, not of a change, loses the model).
DOWNLINK_BITS = (2, 4, 8)


def downlink_config(how: Mapping[str, Any] | None) -> CompressConfig | None:
    """The codec of the downlink of a task compressed as ``how`` (the spec's ``compress`` table),
    or ``None``: the global goes down in float32.

    Examples
    --------
    >>> downlink_config({"bits": 1, "downlink": 8})
    CompressConfig(bits=8, rotation=True, block=1024, downlink=None)
    >>> downlink_config({"bits": 1}) is None
    True
    """
    if how is None or how.get("downlink") is None:
        return None
    cfg = CompressConfig.from_json(dict(how))
    return CompressConfig(bits=cfg.downlink, rotation=cfg.rotation, block=cfg.block)


def downlink_seed(task: str, round_: int, phase: str) -> int:
    """The rotation's seed of ``task``'s global announced for ``round_``, ``phase``."""
    return derive_seed(task, round_, phase, "", "downlink")


def encode_global(
    params: Mapping[str, np.ndarray], config: CompressConfig, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The global as ``{CODES, SCALES}`` and the announcement's ``downlink`` field: the codec,
    the seed and each tensor's dtype and shape (what :func:`decode_global` needs)."""
    zeros = {n: np.zeros(np.shape(a), np.float32) for n, a in params.items()}
    codes = encode(params, zeros, config, seed)
    meta = {
        **config.to_json(),
        "seed": seed,
        "layout": [[n, str(np.asarray(params[n]).dtype), list(np.shape(params[n]))] for n in sorted(params)],
    }
    return codes, meta


def decode_global(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The global :func:`encode_global`'s codes stand for.

    Raises
    ------
    CompressError
        When ``meta`` is not a downlink field or the codes do not fit its layout.
    """
    try:
        config = CompressConfig(bits=meta["bits"], rotation=meta["rotation"], block=meta["block"])
        seed = meta["seed"]
        layout = {str(n): (np.dtype(d), tuple(int(s) for s in shape)) for n, d, shape in meta["layout"]}
        if not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an unsigned 64-bit integer, got {seed!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CompressError(f"a compressed downlink's field is malformed: {exc}") from None
    zeros = {n: np.zeros(shape, np.float32) for n, (_, shape) in layout.items()}
    return decode(arrays, zeros, {n: d.str for n, (d, _) in layout.items()}, config, seed)


def quantize_global(
    how: Mapping[str, Any] | None, task: str, round_: int, phase: str, params: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], tuple[dict[str, np.ndarray], dict[str, Any]]] | None:
    """``(the decoded global, (its codes, the downlink field))`` for ``task``'s ``round_`` and
    ``phase``, or ``None`` where the task sends its global in float32.

    Examples
    --------
    The aggregator runs the phase on the decoded global, which is what a device decodes from
    the announcement's codes and field:

    >>> import numpy as np
    >>> params = {"w": np.array([0.5, -1.0, 2.0, 0.25], np.float32)}
    >>> decoded, (codes, field) = quantize_global({"bits": 1, "downlink": 8}, "t", 3, "train", params)
    >>> print(decoded["w"].round(2))
    [ 0.49 -1.    2.    0.26]
    >>> decode_global(codes, field)["w"].tolist() == decoded["w"].tolist()
    True
    >>> quantize_global(None, "t", 3, "train", params) is None
    True
    """
    config = downlink_config(how)
    if config is None or not params:
        return None
    codes, meta = encode_global(params, config, downlink_seed(task, round_, phase))
    return decode_global(codes, meta), (codes, meta)

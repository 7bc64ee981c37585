"""Containers that name their children: ``Sequential`` and ``Residual``.

A child ``name`` with parameter ``k`` owns the dotted name ``"name.k"`` in the
container's ``Params``; nesting composes (``"encoder.body.fc0.weight"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from trainer_lite.layers.base import Cache, Layer
from trainer_lite.params import Params

# (local name, full dotted name) pairs of one child, resolved once at construction.
_Keys = tuple[tuple[str, str], ...]
_NO_PARAMS: Params = {}


def _child_keys(name: str, layer: Layer) -> _Keys:
    return tuple((k, f"{name}.{k}") for k in layer.param_names())


def _gather(p: Params, keys: _Keys) -> Params:
    """The child's view of ``p`` (no copies); the error names every missing key."""
    if not keys:
        return _NO_PARAMS
    try:
        return {k: p[full] for k, full in keys}
    except KeyError:
        missing = [full for _, full in keys if full not in p]
        raise KeyError(f"missing parameters {missing}; have {sorted(p)}") from None


def _check_names(names: list[str]) -> None:
    if len(set(names)) != len(names) or any("." in n or not n for n in names):
        raise ValueError(f"layer names must be unique, non-empty and dot-free, got {names}")


class Sequential(Layer):
    """Named layers applied in order; parameter names are ``"<layer>.<param>"``.

    Each child's parameter names are resolved once here, so a forward or backward
    pass only looks up the keys it needs instead of scanning the whole dict per
    layer.  Treat ``layers`` as read-only after construction.
    """

    def __init__(self, layers: Sequence[tuple[str, Layer]]) -> None:
        _check_names([n for n, _ in layers])
        self.layers = list(layers)
        self._plan: list[tuple[str, Layer, _Keys]] = [
            (n, layer, _child_keys(n, layer)) for n, layer in layers
        ]
        # Layers before the first one with parameters need no backward pass at all.
        self._first_trainable = next((i for i, (_, _, k) in enumerate(self._plan) if k), len(self._plan))

    def param_names(self) -> list[str]:
        return [full for _, _, keys in self._plan for _, full in keys]

    def init(self, rng: np.random.Generator, *, dtype: np.dtype | type | None = None) -> Params:
        """Fresh parameters, layer by layer in order; ``dtype`` casts them (e.g. ``np.float32``)."""
        out: Params = {}
        for name, layer, _ in self._plan:
            for k, v in layer.init(rng).items():
                out[f"{name}.{k}"] = v if dtype is None else np.asarray(v, dtype=dtype)
        return out

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        caches = []
        for _, layer, keys in self._plan:
            x, c = layer.forward(_gather(p, keys), x)
            caches.append(c)
        return x, caches

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        grads: Params = {}
        for (_, layer, keys), c in zip(reversed(self._plan), reversed(cache), strict=True):
            g, dy = layer.backward(_gather(p, keys), c, dy)
            for k, full in keys:
                grads[full] = g[k]
        return grads, dy

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        """Parameter gradients without the input gradient (what training needs).

        Stops at the first layer with parameters and skips its ``dx``: for FTL-TP's
        624-wide input that drops the largest GEMM of the backward pass.
        """
        grads: Params = {}
        first = self._first_trainable
        for i in range(len(self._plan) - 1, first - 1, -1):
            _, layer, keys = self._plan[i]
            sub = _gather(p, keys)
            if i == first:
                g = layer.param_grads(sub, cache[i], dy)
            else:
                g, dy = layer.backward(sub, cache[i], dy)
            for k, full in keys:
                grads[full] = g[k]
        return grads

    def names(self, layer: str) -> list[str]:
        """The parameter names that belong to the named sub-layer."""
        for name, _, keys in self._plan:
            if name == layer:
                return [full for _, full in keys]
        raise KeyError(f"no layer {layer!r}; layers are {[n for n, _ in self.layers]}")

    def input_width(self) -> int | None:
        return self.layers[0][1].input_width() if self.layers else None


class Residual(Layer):
    """``y = body(x) + shortcut(x)``, with the identity when ``shortcut`` is ``None``.

    The PFL-DA authors' NN encoder is ``Residual(mlp([1, 64, 128]), Linear(1, 128))``:
    their ``sc(x) + input_to_hidden(x)``.  Parameters are ``"body.*"`` and
    ``"shortcut.*"``.
    """

    def __init__(self, body: Layer, shortcut: Layer | None = None) -> None:
        self.body, self.shortcut = body, shortcut
        self._body_keys = _child_keys("body", body)
        self._sc_keys = _child_keys("shortcut", shortcut) if shortcut is not None else ()

    def param_names(self) -> list[str]:
        return [full for _, full in self._body_keys + self._sc_keys]

    def init(self, rng: np.random.Generator) -> Params:
        out = {f"body.{k}": v for k, v in self.body.init(rng).items()}
        if self.shortcut is not None:
            out.update({f"shortcut.{k}": v for k, v in self.shortcut.init(rng).items()})
        return out

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Cache]:
        y, body_cache = self.body.forward(_gather(p, self._body_keys), x)
        if self.shortcut is None:
            if y.shape != x.shape:
                raise ValueError(
                    f"identity shortcut needs body output shape {y.shape} == input shape {x.shape}; "
                    "pass a shortcut layer that maps the input to the body's output width"
                )
            return y + x, (body_cache, None)
        s, sc_cache = self.shortcut.forward(_gather(p, self._sc_keys), x)
        # Out of place: the body may keep its output in its cache.
        return y + s, (body_cache, sc_cache)

    def _run_backward(
        self, p: Params, cache: Cache, dy: np.ndarray, need_dx: bool
    ) -> tuple[Params, np.ndarray | None]:
        body_cache, sc_cache = cache
        grads: Params = {}
        if need_dx:
            g, dx = self.body.backward(_gather(p, self._body_keys), body_cache, dy)
        else:
            g, dx = self.body.param_grads(_gather(p, self._body_keys), body_cache, dy), None
        for k, full in self._body_keys:
            grads[full] = g[k]
        if self.shortcut is None:
            return grads, (dx + dy if need_dx else None)
        sub = _gather(p, self._sc_keys)
        if need_dx:
            g, dx_sc = self.shortcut.backward(sub, sc_cache, dy)
            dx = dx + dx_sc
        else:
            g = self.shortcut.param_grads(sub, sc_cache, dy)
        for k, full in self._sc_keys:
            grads[full] = g[k]
        return grads, dx

    def backward(self, p: Params, cache: Cache, dy: np.ndarray) -> tuple[Params, np.ndarray]:
        grads, dx = self._run_backward(p, cache, dy, need_dx=True)
        return grads, cast(np.ndarray, dx)

    def param_grads(self, p: Params, cache: Cache, dy: np.ndarray) -> Params:
        return self._run_backward(p, cache, dy, need_dx=False)[0]

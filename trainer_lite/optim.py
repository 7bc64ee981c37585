"""Optimizers over named parameters, with torch.optim's update rules.

An optimizer updates the arrays of the ``Params`` it is given in place: pass it
your own training copy (see ``trainer_lite.params.copy_params``).  Its state is
keyed by parameter name, so it can be saved with the device's local state.

The updates run in place through ``out=`` buffers kept per parameter, so a step
allocates nothing after the first: on a Pi the optimizer is most of the step time
of a small MLP, and temporaries would double its memory traffic.  State and
buffers take each parameter's dtype (float32 parameters stay float32).

Every ``FLUSH_EVERY`` steps, magnitudes below ``2**40`` times the dtype's smallest
normal number (about 1e-26 in float32) are set to zero in the optimizer state and
the updated parameters.  Moments of dead units decay geometrically into subnormal
numbers within a few hundred steps, and x86 CPUs run subnormal arithmetic up to
100× slower (torch's kernels avoid this with flush-to-zero, which NumPy cannot
set); such values move no weight by anything representable next to eps.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from trainer_lite.params import Params

FLUSH_EVERY = 32


def flush_tiny(arr: np.ndarray) -> None:
    """Zero, in place, the entries of a float array too small to matter (see the module notes)."""
    if arr.dtype.kind == "f":
        np.copyto(arr, 0, where=np.abs(arr) < np.finfo(arr.dtype).tiny * 2.0**40)


class Optimizer(ABC):
    """Base class: ``step(params, grads)`` updates ``params[name]`` for every name in ``grads``.

    Names absent from ``grads`` are left untouched, as torch skips parameters
    whose ``.grad`` is ``None``.
    """

    def __init__(self, lr: float, weight_decay: float = 0.0) -> None:
        if lr <= 0 or weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={lr}, weight_decay={weight_decay}")
        self.lr = lr
        self.weight_decay = weight_decay
        self.state: dict[str, np.ndarray] = {}
        self._scratch: dict[str, np.ndarray] = {}

    @abstractmethod
    def step(self, params: Params, grads: Params) -> None:
        """Apply one update in place."""

    def _buffer(self, key: str, like: np.ndarray) -> np.ndarray:
        """A reusable scratch array shaped like ``like`` (not part of the saved state)."""
        buf = self._scratch.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = np.empty_like(like)
            self._scratch[key] = buf
        return buf

    def _decayed(self, name: str, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        """``g + weight_decay·p`` (torch's coupled L2) in a scratch buffer; ``g`` itself when 0."""
        if not self.weight_decay:
            return g
        out = self._buffer("g." + name, p)
        np.multiply(p, self.weight_decay, out=out)
        out += g
        return out


def _check_grad(name: str, p: np.ndarray, g: np.ndarray) -> None:
    if g.shape != p.shape:
        raise ValueError(f"gradient of {name!r} has shape {g.shape} but the parameter has {p.shape}")


class SGD(Optimizer):
    """``torch.optim.SGD``: L2 weight decay added to the gradient, heavy-ball momentum.

    Parameters
    ----------
    lr
        Learning rate.
    momentum
        Heavy-ball coefficient; the first step seeds the buffer with the gradient.
    weight_decay
        Coupled L2: ``g ← g + weight_decay·p``.
    dampening
        ``buf ← momentum·buf + (1 − dampening)·g`` after the first step.
    nesterov
        Nesterov momentum (needs ``momentum > 0`` and ``dampening = 0``, as torch).
    """

    def __init__(
        self,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        *,
        dampening: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        super().__init__(lr, weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0")
        self.momentum = momentum
        self.dampening = dampening
        self.nesterov = nesterov
        self._steps = 0

    def step(self, params: Params, grads: Params) -> None:
        mu, lr = self.momentum, self.lr
        for name, g in grads.items():
            p = params[name]
            _check_grad(name, p, g)
            g = self._decayed(name, p, g)
            if mu:
                buf = self.state.get(name)
                if buf is None:
                    buf = np.array(g, dtype=p.dtype, copy=True)
                    self.state[name] = buf
                else:
                    buf *= mu
                    if self.dampening:
                        buf += (1.0 - self.dampening) * g
                    else:
                        buf += g
                if self.nesterov:
                    upd = self._buffer("u." + name, p)
                    np.multiply(buf, mu, out=upd)
                    upd += g
                    g = upd
                else:
                    g = buf
            upd = self._buffer("u." + name, p)
            np.multiply(g, lr, out=upd)
            p -= upd
        self._steps += 1
        if self._steps % FLUSH_EVERY == 0:
            for name in grads:
                flush_tiny(params[name])
                if name in self.state:
                    flush_tiny(self.state[name])


class _FlatGroup:
    """Adam's moments for a fixed tuple of same-dtype parameters, as one flat array each.

    The per-name state entries are views into ``m`` and ``v``, so the saved state
    keeps its names while a step runs a dozen whole-model array operations
    instead of a dozen per parameter (per-call overhead dominates small models).
    """

    def __init__(self, names: tuple[str, ...], params: Params, state: dict[str, np.ndarray], t: int) -> None:
        self.names = names
        self.shapes = [params[n].shape for n in names]
        self.dtype = params[names[0]].dtype
        sizes = [math.prod(s) for s in self.shapes]
        total = sum(sizes)
        self.m = np.zeros(total, self.dtype)
        self.v = np.zeros(total, self.dtype)
        self.g = np.empty(total, self.dtype)
        self.a = np.empty(total, self.dtype)
        self.m_views: dict[str, np.ndarray] = {}
        self.v_views: dict[str, np.ndarray] = {}
        self.a_views: list[tuple[str, np.ndarray]] = []
        offset = 0
        for n, shape, size in zip(names, self.shapes, sizes, strict=True):
            sl = slice(offset, offset + size)
            mv, vv = self.m[sl].reshape(shape), self.v[sl].reshape(shape)
            # Carry over moments a per-parameter step (or a loaded state) left behind.
            if "m." + n in state:
                mv[...] = state["m." + n]
                vv[...] = state["v." + n]
            state["m." + n], state["v." + n] = mv, vv
            self.m_views[n], self.v_views[n] = mv, vv
            self.a_views.append((n, self.a[sl].reshape(shape)))
            offset += size
        self.t = t

    def matches(
        self, params: Params, grads: Params, state: dict[str, np.ndarray], steps: dict[str, int]
    ) -> bool:
        """Whether this layout still describes ``grads``, ``params``, the state and the step counts."""
        if tuple(grads) != self.names:
            return False
        for n, shape in zip(self.names, self.shapes, strict=True):
            p = params[n]
            if (
                p.shape != shape
                or p.dtype != self.dtype
                or grads[n].shape != shape
                or state.get("m." + n) is not self.m_views[n]
                or state.get("v." + n) is not self.v_views[n]
                or steps.get(n, 0) != self.t
            ):
                return False
        return True


class Adam(Optimizer):
    """``torch.optim.Adam`` (coupled L2 weight decay, bias-corrected moments).

    State: ``"m.<name>"`` and ``"v.<name>"``, torch's first and second moments
    divided by ``1 − β1`` and ``1 − β2`` (which saves two passes per step), and
    the per-name step count in ``t``.  When every step updates the same names, the
    moments live in one flat array per kind and the state entries are views into
    it (rebound on the first step; assign new state arrays freely, they are
    picked up).

    Parameters
    ----------
    lr, betas, eps
        As in torch.
    weight_decay
        Coupled L2 (``g ← g + weight_decay·p``), as ``torch.optim.Adam``.
    """

    decoupled = False

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr, weight_decay)
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0) or eps < 0:
            raise ValueError(f"need betas in [0, 1) and eps >= 0, got betas={betas}, eps={eps}")
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.t: dict[str, int] = {}
        self._flat: _FlatGroup | None = None

    def step(self, params: Params, grads: Params) -> None:
        if not grads:
            return
        grp = self._flat
        if grp is None or not grp.matches(params, grads, self.state, self.t):
            grp = self._flat = self._try_flat(params, grads)
        if grp is None:
            self._step_each(params, grads)
        else:
            self._step_flat(grp, params, grads)

    def _try_flat(self, params: Params, grads: Params) -> _FlatGroup | None:
        names = tuple(grads)
        for n in names:
            _check_grad(n, params[n], grads[n])
        dtypes = {params[n].dtype for n in names}
        steps = {self.t.get(n, 0) for n in names}
        if len(dtypes) != 1 or len(steps) != 1 or next(iter(dtypes)).kind != "f":
            return None
        return _FlatGroup(names, params, self.state, steps.pop())

    def _update(self, m: np.ndarray, v: np.ndarray, g: np.ndarray, a: np.ndarray, t: int) -> None:
        """Advance the moments ``m``, ``v`` with ``g``; leave the step to subtract in ``a``.

        The moments are kept unnormalised, ``m̃ = m/(1 − β1)`` and ``ṽ = v/(1 − β2)``,
        so their updates need no scaled copy of ``g``: eleven passes over the
        parameters per step instead of thirteen.  torch's step

            lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps)

        equals ``lr·(1 − β1)/bc1 · k · m̃ / (sqrt(ṽ) + eps·k)`` with
        ``k = sqrt(bc2/(1 − β2))``.
        """
        b1, b2 = self.beta1, self.beta2
        m *= b1
        m += g
        v *= b2
        np.multiply(g, g, out=a)
        v += a
        k = math.sqrt((1.0 - b2**t) / (1.0 - b2))
        np.sqrt(v, out=a)
        a += self.eps * k
        np.divide(m, a, out=a)
        a *= self.lr * (1.0 - b1) / (1.0 - b1**t) * k

    def _step_flat(self, grp: _FlatGroup, params: Params, grads: Params) -> None:
        t = grp.t + 1
        g, a = grp.g, grp.a
        np.concatenate([grads[n].ravel() for n in grp.names], out=g)
        if self.weight_decay:
            if self.decoupled:
                shrink = 1.0 - self.lr * self.weight_decay
                for n in grp.names:
                    params[n] *= shrink
            else:
                np.concatenate([params[n].ravel() for n in grp.names], out=a)
                a *= self.weight_decay
                g += a
        self._update(grp.m, grp.v, g, a, t)
        for n, step in grp.a_views:
            params[n] -= step
            self.t[n] = t
        grp.t = t
        if t % FLUSH_EVERY == 0:
            flush_tiny(grp.m)
            flush_tiny(grp.v)
            for n in grp.names:
                flush_tiny(params[n])

    def _step_each(self, params: Params, grads: Params) -> None:
        for name, g in grads.items():
            p = params[name]
            _check_grad(name, p, g)
            m = self.state.get("m." + name)
            if m is None:
                m = np.zeros_like(p)
                v = np.zeros_like(p)
                self.state["m." + name], self.state["v." + name] = m, v
            else:
                v = self.state["v." + name]
            t = self.t.get(name, 0) + 1
            self.t[name] = t
            if self.decoupled:
                # AdamW: p ← p·(1 − lr·wd) before the moment update; g is left alone.
                if self.weight_decay:
                    p *= 1.0 - self.lr * self.weight_decay
            else:
                g = self._decayed(name, p, g)
            a = self._buffer("a." + name, p)
            self._update(m, v, g, a, t)
            p -= a
            if t % FLUSH_EVERY == 0:
                for arr in (m, v, p):
                    flush_tiny(arr)


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay ``p ← p·(1 − lr·wd)``.

    torch's default ``weight_decay`` for AdamW is 0.01; here it stays 0 unless given.
    """

    decoupled = True

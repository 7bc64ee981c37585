"""Optimizers over named parameters, with torch.optim's update rules.

An optimizer updates the arrays of the ``Params`` it is given in place: pass it
your own training copy (see ``trainer_lite.params.copy_params``).  Its state is
keyed by parameter name, so it can be saved with the device's local state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from trainer_lite.params import Params


class Optimizer(ABC):
    """Base class: ``step(params, grads)`` updates ``params[name]`` for every name in ``grads``."""

    def __init__(self, lr: float, weight_decay: float = 0.0) -> None:
        if lr <= 0 or weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={lr}, weight_decay={weight_decay}")
        self.lr = lr
        self.weight_decay = weight_decay
        self.state: dict[str, np.ndarray] = {}

    @abstractmethod
    def step(self, params: Params, grads: Params) -> None:
        """Apply one update in place."""


class SGD(Optimizer):
    """``torch.optim.SGD``: L2 weight decay added to the gradient, heavy-ball momentum."""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(lr, weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum

    def step(self, params: Params, grads: Params) -> None:
        for name, g in grads.items():
            p = params[name]
            if self.weight_decay:
                g = g + self.weight_decay * p
            if self.momentum:
                buf = self.state.get(name)
                buf = g.copy() if buf is None else self.momentum * buf + g
                self.state[name] = buf
                g = buf
            p -= self.lr * g


class Adam(Optimizer):
    """``torch.optim.Adam`` (coupled L2 weight decay, bias-corrected moments)."""

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr, weight_decay)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.t: dict[str, int] = {}

    def step(self, params: Params, grads: Params) -> None:
        b1, b2 = self.beta1, self.beta2
        for name, g in grads.items():
            p = params[name]
            if self.weight_decay:
                g = g + self.weight_decay * p
            m = self.state.get("m." + name)
            if m is None:
                m = np.zeros_like(p)
                v = np.zeros_like(p)
                self.state["m." + name], self.state["v." + name] = m, v
            else:
                v = self.state["v." + name]
            t = self.t.get(name, 0) + 1
            self.t[name] = t
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * (g * g)
            step = self.lr / (1 - b1**t)
            denom = np.sqrt(v / (1 - b2**t))
            denom += self.eps
            p -= step * m / denom

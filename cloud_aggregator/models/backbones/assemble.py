"""What the fleet learned, as a torch module: federated shared parameters → ``nn.Module`` → ONNX.

A ``trainer_lite`` model is a tree of named layers over a flat ``name -> ndarray``
dict.  :func:`assemble` mirrors the tree in torch with the same names, loads the
arrays, and keeps only the blocks asked for — e.g. FedDAR's ``encoder``, FedRep's
body, or FTL-TP's shared base layers ``fc0, relu0`` — so the fleet's encoder can be
exported and pushed like a cloud backbone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from cloud_aggregator.models.backbones.nets import TLLinear
from trainer_lite.layers import Affine, Layer, Linear, ReLU, Residual, Sequential, SigmoidGLM
from trainer_lite.models import build_model

SUPPORTED = ("Sequential", "Linear", "ReLU", "Affine", "SigmoidGLM", "Residual")


class _Sequential(nn.Module):
    """Children applied in order, registered under the trainer_lite block names."""

    def __init__(self, children: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.order = [name for name, _ in children]
        for name, child in children:
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            x = getattr(self, name)(x)
        return x


class _Affine(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.shift = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class _SigmoidGLM(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) @ self.weight + self.bias


class _Residual(nn.Module):
    def __init__(self, body: nn.Module, shortcut: nn.Module | None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + (self.shortcut(x) if self.shortcut is not None else x)


def to_torch(layer: Layer) -> nn.Module:
    """The torch mirror of a trainer_lite layer (parameters uninitialized; see :func:`load_params`)."""
    if isinstance(layer, Sequential):
        return _Sequential([(name, to_torch(child)) for name, child in layer.layers])
    if isinstance(layer, Linear):
        return TLLinear(layer.d_in, layer.d_out, bias=layer.bias)
    if isinstance(layer, ReLU):
        return nn.ReLU()
    if isinstance(layer, Affine):
        return _Affine(layer.dim)
    if isinstance(layer, SigmoidGLM):
        return _SigmoidGLM(layer.linear.d_in, layer.linear.d_out)
    if isinstance(layer, Residual):
        return _Residual(
            to_torch(layer.body), to_torch(layer.shortcut) if layer.shortcut is not None else None
        )
    raise ValueError(f"cannot assemble a {type(layer).__name__} in torch; supported layers: {SUPPORTED}")


def load_params(module: nn.Module, params: Mapping[str, np.ndarray]) -> nn.Module:
    """Copy ``params`` into ``module`` by name; every parameter must be given, with its shape."""
    own = dict(module.named_parameters())
    missing = sorted(set(own) - set(params))
    unexpected = sorted(set(params) - set(own))
    if missing or unexpected:
        raise KeyError(
            f"parameters differ from the assembled module's: missing {missing}, unexpected {unexpected}"
        )
    with torch.no_grad():
        for name, p in own.items():
            arr = np.asarray(params[name])
            if tuple(arr.shape) != tuple(p.shape):
                raise ValueError(f"{name!r} has shape {arr.shape}, the module expects {tuple(p.shape)}")
            if not np.isfinite(arr).all():
                raise ValueError(f"{name!r} holds NaN or Inf")
            p.copy_(torch.as_tensor(arr, dtype=p.dtype))
    return module


def assemble(
    model: str,
    model_args: Mapping[str, object],
    params: Mapping[str, np.ndarray],
    *,
    blocks: Sequence[str] | None = None,
    prefix: str = "",
) -> nn.Module:
    """A torch module of ``blocks`` of a registered trainer_lite ``model``, holding ``params``.

    Parameters
    ----------
    model, model_args
        As in the task spec (``trainer_lite.models.build_model``).
    params
        Named arrays (e.g. a task's final global parameters); those under the kept
        blocks are used, with ``prefix`` stripped first (FedDAR-style dicts that hold
        heads under ``heads.<m>.`` too are fine: only the kept names are read).
    blocks
        Consecutive top-level block names to keep, from the input side; ``None`` keeps all.
    """
    tl = build_model(model, **dict(model_args))
    names = [n for n, _ in tl.layers]
    keep = names if blocks is None else list(blocks)
    if keep != names[: len(keep)]:
        raise ValueError(f"blocks {keep} must be a leading run of the model's blocks {names}")
    sub = Sequential([(n, layer) for n, layer in tl.layers if n in keep])
    module = to_torch(sub).eval()
    if prefix:
        params = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
    wanted = set(sub.param_names())
    return load_params(module, {k: v for k, v in params.items() if k in wanted})

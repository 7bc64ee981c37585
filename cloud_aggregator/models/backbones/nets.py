"""Torch modules of the cloud backbones, named the way the fleet names parameters.

Linear maps store their weight ``(d_in, d_out)`` as ``trainer_lite.layers.Linear``
does, so ``"fc0.weight"`` is the same array in a NumPy head, a torch module and the
ONNX initializer the legacy exporter writes (no transpose in between).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


class TLLinear(nn.Module):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(d_in, d_out)`` (trainer_lite's layout)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = True) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(d_in)  # torch.nn.Linear's default init
        self.weight = nn.Parameter(torch.empty(d_in, d_out).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(d_out).uniform_(-bound, bound)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y + self.bias if self.bias is not None else y


class Standardize(nn.Module):
    """``(x - mean) / std`` with statistics fixed from the training set (buffers, not parameters)."""

    def __init__(self, mean: np.ndarray, std: np.ndarray) -> None:
        super().__init__()
        std = np.where(np.asarray(std) > 1e-8, std, 1.0)
        self.register_buffer("mean", torch.as_tensor(np.asarray(mean), dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class VibrationCNN(nn.Module):
    """1D-CNN encoder over raw vibration windows ``(batch, axes, window)`` → ``(batch, embed)``.

    Three strided convolutions (receptive field ~0.2 s at 227 Hz, enough for the
    belt tone and the frame resonance), a global mean and RMS over time (so both
    spectral shape and vibration level reach the embedding), then a linear map.
    """

    def __init__(self, axes: int = 2, channels: tuple[int, ...] = (16, 32, 32), embed: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = axes
        for i, c in enumerate(channels):
            k = 7 if i == 0 else 5
            layers += [nn.Conv1d(c_in, c, k, stride=2, padding=k // 2), nn.ReLU()]
            c_in = c
        self.conv = nn.Sequential(*layers)
        self.fc = TLLinear(2 * c_in, embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        pooled = torch.cat([h.mean(dim=-1), torch.sqrt(torch.mean(h * h, dim=-1) + 1e-6)], dim=-1)
        return torch.relu(self.fc(pooled))


class FeatureMLP(nn.Module):
    """MLP encoder over feature vectors (FTL-TP's 624-175-125-50), standardized inside the graph.

    ReLU between layers, tanh on the embedding.
    """

    def __init__(self, mean: np.ndarray, std: np.ndarray, sizes: tuple[int, ...] = (175, 125, 50)) -> None:
        super().__init__()
        self.norm = Standardize(mean, std)
        widths = [len(mean), *sizes]
        for i in range(len(sizes)):
            self.add_module(f"fc{i}", TLLinear(widths[i], widths[i + 1]))
        self.depth = len(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        for i in range(self.depth - 1):
            h = torch.relu(getattr(self, f"fc{i}")(h))
        # A bounded embedding: float32 rounding stays far below the 1e-5 parity bar (ReLU
        # embeddings of heavy-tailed DWT features reached ~50, i.e. ulps of ~4e-6), and the
        # devices' NumPy heads train on inputs of a known scale.
        return torch.tanh(getattr(self, f"fc{self.depth - 1}")(h))


class Backbone(nn.Module):
    """An encoder and the task head it was trained with; ``encoder`` alone is what devices embed with."""

    def __init__(self, encoder: nn.Module, embed_dim: int, n_outputs: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = TLLinear(embed_dim, n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def build_backbone(kind: str, *, input_shape: tuple[int, ...], n_outputs: int, stats: dict) -> Backbone:
    """``printer-cnn`` (raw windows) or ``weld-mlp`` (DWT features); ``stats`` holds the training mean/std."""
    if kind == "printer-cnn":
        axes = input_shape[0]
        return Backbone(VibrationCNN(axes=axes, embed=32), 32, n_outputs)
    if kind == "weld-mlp":
        return Backbone(FeatureMLP(stats["mean"], stats["std"]), 50, n_outputs)
    raise ValueError(f"unknown backbone {kind!r}; choose 'printer-cnn' or 'weld-mlp'")


#: Which training set each backbone learns from.
BACKBONE_DATA = {"printer-cnn": "printer-windows", "weld-mlp": "weld-features"}

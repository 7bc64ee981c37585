"""Train a cloud backbone: seeded, with a progress bar, a checkpoint per epoch, resumable.

A run lives in one folder: ``data.safetensors`` (the training set, built once from
the simulators so a resume does not rebuild it), ``checkpoint.pt`` (settings, epoch,
model, optimizer, history; written atomically each epoch) and ``backbone.json``
(settings and the final scores, for people).  Starting a run in a folder whose
checkpoint has the same settings continues after its last epoch; each epoch's
shuffle is drawn from ``(seed, epoch)``, so an interrupted and resumed run ends
with the same weights as an uninterrupted one (on CPU).

CPU by default; ``device="auto"`` takes a GPU when torch sees one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from cloud_aggregator.models.backbones.data import BackboneData, build_data
from cloud_aggregator.models.backbones.nets import BACKBONE_DATA, Backbone, build_backbone

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.pt"
DATA = "data.safetensors"
SUMMARY = "backbone.json"


@dataclass(frozen=True)
class TrainSettings:
    """Everything that determines a run (a checkpoint resumes only under the same settings,
    except ``epochs``, which may grow to extend a finished run)."""

    backbone: str
    epochs: int = 30
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 1e-4
    seed: int = 0
    data_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backbone not in BACKBONE_DATA:
            raise ValueError(f"unknown backbone {self.backbone!r}; choose one of {sorted(BACKBONE_DATA)}")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("need epochs >= 1, batch_size >= 1 and lr > 0")


@dataclass
class TrainResult:
    model: Backbone
    data: BackboneData
    settings: TrainSettings
    history: list[dict[str, float]]
    out_dir: Path


def pick_device(device: str = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else CPU; or an explicit torch device string."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _stats(data: BackboneData) -> dict[str, np.ndarray]:
    return {"mean": data.x_train.mean(axis=0), "std": data.x_train.std(axis=0)}


def new_model(settings: TrainSettings, data: BackboneData) -> Backbone:
    torch.manual_seed(settings.seed)
    return build_backbone(
        settings.backbone, input_shape=data.input_shape, n_outputs=data.n_outputs, stats=_stats(data)
    )


def evaluate(model: nn.Module, data: BackboneData, device: torch.device) -> dict[str, float]:
    """Test loss and the task's score (accuracy, or R² of the speed)."""
    model.eval()
    with torch.no_grad():
        out = model(torch.as_tensor(data.x_test, device=device)).cpu().numpy()
    if data.task == "classification":
        y = data.y_test
        logits = out - out.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return {
            "test_loss": float(-logp[np.arange(len(y)), y].mean()),
            "test_accuracy": float(np.mean(out.argmax(1) == y)),
        }
    y = data.y_test
    sse = float(np.sum((out - y) ** 2))
    return {"test_loss": sse / y.size, "test_r2": 1.0 - sse / float(np.sum((y - y.mean(axis=0)) ** 2))}


def _without_epochs(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k != "epochs"}


def _save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(payload, tmp)
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_run(
    out_dir: str | Path, map_location: str = "cpu"
) -> tuple[Backbone, BackboneData, TrainSettings, dict]:
    """The model, data and settings of a run folder (for export)."""
    out_dir = Path(out_dir)
    ckpt = torch.load(out_dir / CHECKPOINT, map_location=map_location, weights_only=True)
    settings = TrainSettings(**ckpt["settings"])
    data = BackboneData.load(out_dir / DATA)
    model = new_model(settings, data)
    model.load_state_dict(ckpt["model"])
    return model.eval(), data, settings, ckpt


def _run_data(out_dir: Path, settings: TrainSettings, data: BackboneData | None) -> BackboneData:
    """The run's training set: the one saved in ``out_dir``, else ``data`` or one built from the
    settings (saved there)."""
    if (out_dir / DATA).exists():
        return BackboneData.load(out_dir / DATA)
    if data is None:
        data = build_data(BACKBONE_DATA[settings.backbone], **settings.data_args)
    data.save(out_dir / DATA)
    return data


def _resume(
    ckpt_path: Path, settings: TrainSettings, model: nn.Module, opt: torch.optim.Optimizer, dev: torch.device
) -> tuple[list[dict[str, float]], int]:
    """Load the checkpoint at ``ckpt_path`` into ``model`` and ``opt``, if there is one; its history
    and the epoch to go on from (none: ``[]`` and 0)."""
    if not ckpt_path.exists():
        return [], 0
    ckpt = torch.load(ckpt_path, map_location=dev, weights_only=True)
    # More epochs extend a run (each epoch's shuffle depends only on seed and epoch); anything
    # else would mix two different runs in one checkpoint.
    if _without_epochs(ckpt["settings"]) != _without_epochs(asdict(settings)):
        raise ValueError(
            f"{ckpt_path} was written with other settings {ckpt['settings']}; use a new folder "
            "or delete the checkpoint to start over"
        )
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    start = int(ckpt["epoch"])
    log.info("resuming %s from epoch %d in %s", settings.backbone, start, ckpt_path.parent)
    return list(ckpt["history"]), start


def _train_epoch(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: BackboneData,
    settings: TrainSettings,
    epoch: int,
    dev: torch.device,
) -> float:
    """One pass over the training set in an order drawn from the seed and ``epoch``; the mean loss."""
    model.train()
    loss_fn: nn.Module = nn.CrossEntropyLoss() if data.task == "classification" else nn.MSELoss()
    x_all, y_all = torch.as_tensor(data.x_train), torch.as_tensor(data.y_train)
    n = len(x_all)
    gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=gen)
    total = 0.0
    for i in range(0, n, settings.batch_size):
        idx = order[i : i + settings.batch_size]
        xb, yb = x_all[idx].to(dev), y_all[idx].to(dev)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        total += float(loss.detach()) * len(idx)
    return total / n


def _write_summary(
    out_dir: Path,
    settings: TrainSettings,
    dev: torch.device,
    data: BackboneData,
    history: list[dict[str, float]],
) -> None:
    """``summary.json``: the settings, device and data of the run, and its last epoch's scores."""
    summary = {"settings": asdict(settings), "device": str(dev), "data": data.description,
               "schema_hash": data.schema_hash, "epochs_done": len(history),
               "final": history[-1] if history else {}}  # fmt: skip
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1, sort_keys=True))


def train_backbone(
    settings: TrainSettings,
    out_dir: str | Path,
    *,
    device: str = "auto",
    progress: bool = True,
    data: BackboneData | None = None,
    stop_after: int | None = None,
    threads: int | None = None,
) -> TrainResult:
    """Train (or resume) the run in ``out_dir``.

    Parameters
    ----------
    data
        Use this training set instead of building it from ``settings.data_args``
        (it is saved in the run folder either way).
    stop_after
        Stop after this many epochs of *this call* (to test resuming).
    threads
        torch intra-op threads on CPU (``None``: torch's default, one per core).  On a
        shared small machine set 1: two threads contending with other processes ran a
        training step ~90x slower here (700 ms vs 7.5 ms).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = pick_device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    data = _run_data(out_dir, settings, data)
    model = new_model(settings, data).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    ckpt_path = out_dir / CHECKPOINT
    history, start = _resume(ckpt_path, settings, model, opt, dev)
    end = settings.epochs if stop_after is None else min(settings.epochs, start + stop_after)
    bar = tqdm(
        range(start, end), desc=settings.backbone, initial=start, total=settings.epochs, disable=not progress
    )
    for epoch in bar:
        started = time.perf_counter()
        train_loss = _train_epoch(model, opt, data, settings, epoch, dev)
        scores = {"epoch": epoch + 1, "train_loss": train_loss, **evaluate(model, data, dev)}
        scores["seconds"] = time.perf_counter() - started
        history.append(scores)
        bar.set_postfix({k: f"{v:.4f}" for k, v in scores.items() if k.startswith("test_")})
        _save_checkpoint(ckpt_path, {"settings": asdict(settings), "epoch": epoch + 1, "model": model.state_dict(),
                                     "optimizer": opt.state_dict(), "history": history})  # fmt: skip
    bar.close()
    _write_summary(out_dir, settings, dev, data, history)
    return TrainResult(model.cpu().eval(), data, settings, history, out_dir)

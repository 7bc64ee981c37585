"""Run the PFL-DA authors' printer study (their ``printer.py``) on CPU, from their seeds or from ours.

``python -m benchmarks.authors_ditto --repo PATH [--fed Ditto] [--seeds 0 1 2] [--ours]``

``PATH`` is a checkout of UMDataScienceLab/Personalized_FL_with_DA (checked at cf061fd); nothing
of it is copied into this project.  Their ``printer_dataset/printer.py`` imports pandas and
torchvision, which this project does not install and ``train()`` does not use: the module is
loaded with those two import lines blanked and its CSV loader replaced by one reading the same
files the same way (first row dropped, as ``pd.read_csv`` takes it for a header), printers in
sorted order.  ``train()`` itself runs unchanged, on CPU.  Needs torch (the ``cloud`` extra).

``--ours`` starts each seed from this project's initial parameters for that seed (the global
model and every printer's personal model, as :mod:`benchmarks.pflda_printers` draws them), so
a trajectory can be compared step for step with ours (:mod:`benchmarks.ditto_diagnose`).
Sigmoid GLM only.  Prints per seed the final test loss 50·MSE(s/50), the round after which the
global decoder's amplitude ``w1`` last changed sign, and the test loss at a few rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import types
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.pflda_printers import DEFAULT_DATA, method_spec
from cloud_aggregator.aggregation.strategies import make_strategy
from trainer_lite.algorithms import make_client
from trainer_lite.client import derive_rng

SHOW = (1, 10, 50, 100, 150, 200)
METHODS = {"Ditto": "ditto", "indiv": "indiv", "PDA": "pflda"}


def load_printer_module(repo: Path) -> types.ModuleType:
    """Their ``printer.py`` as a module, with the unused pandas/torchvision imports blanked."""
    folder = repo / "printer_dataset"
    source = (folder / "printer.py").read_text()
    for line in ("import pandas as pd", "from torchvision import datasets, transforms"):
        if line not in source:
            raise ValueError(f"{folder / 'printer.py'} has no line {line!r}: not the checked version")
        source = source.replace(line, "pass  # blanked: unused by train()")
    sys.path.insert(0, str(folder))  # for their modeloperations
    module = types.ModuleType("authors_printer")
    module.__file__ = str(folder / "printer.py")
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # their code, run as is
    return module


def read_files(data: Path) -> dict[int, dict[int, dict[str, np.ndarray]]]:
    """Their ``load_all_files`` result: ``{printer: {speed: {"data": rows}}}``, header row dropped."""
    out: dict[int, dict[int, dict[str, np.ndarray]]] = {}
    for path in sorted(data.iterdir()):
        m = re.fullmatch(r"FL_Dataset_Printer(\d+)_Speed(\d+)\.csv", path.name)
        if m:
            rows = np.loadtxt(path, delimiter=",", ndmin=2)[1:]
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = {"data": rows}
    return {p: dict(sorted(v.items())) for p, v in sorted(out.items())}


def our_start(fed: str, seed: int) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """This project's initial global and per-printer personal parameters for ``seed``."""
    spec = replace(method_spec("sigmoid", METHODS[fed], seed), seed=seed)
    personal = [make_client(spec).init_local(derive_rng(seed, f"printer{p}", "init")) for p in range(1, 7)]
    return make_strategy(spec).init_global(), [
        {k.removeprefix("personal."): v for k, v in p.items()} for p in personal
    ]


def _set(torch: Any, encoder: Any, decoder: Any, p: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        encoder.sc.weight.copy_(torch.tensor(np.asarray(p["encoder.scale"], np.float32).reshape(1, 1)))
        encoder.sc.bias.copy_(torch.tensor(np.asarray(p["encoder.shift"], np.float32).reshape(1)))
        decoder.fc2.weight.copy_(torch.tensor(np.asarray(p["decoder.weight"], np.float32).reshape(1, 1)))
        decoder.fc2.bias.copy_(torch.tensor(np.asarray(p["decoder.bias"], np.float32).reshape(1)))


def run_seed(module: types.ModuleType, data: Path, fed: str, seed: int, ours: bool) -> dict[str, Any]:
    """One run of their ``train()`` (200 rounds, sigmoid GLM); returns its losses and ``w1`` by round."""
    import random

    import torch

    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    files = read_files(data)
    module.load_all_files = lambda rdir: files
    dataset = module.PtData()
    # Built in their one_experinemt's order, so their seed draws the same parameters.
    enc = module.Encoder_sigmoid(feature_dim=1)
    encs = [module.Encoder_sigmoid(feature_dim=1) for _ in range(6)]
    dec = module.Decoder_sigmoid(feature_dim=1)
    decs = [module.Decoder_sigmoid(feature_dim=1) for _ in range(6)]
    if ours:
        glob, personal = our_start(fed, seed)
        _set(torch, enc, dec, glob)
        for e, d, p in zip(encs, decs, personal, strict=True):
            _set(torch, e, d, p)
    start = {"a0": enc.sc.weight.item(), "w1": dec.fc2.weight.item(), "w2": dec.fc2.bias.item()}
    w1: list[float] = []
    test_loss = module.test_loss

    def traced(dataset, encoder, encoders, decoder, decoders, *args, test=1, **kw):
        if test == 1:
            w1.append(decoder.fc2.weight.item())
        return test_loss(dataset, encoder, encoders, decoder, decoders, *args, test=test, **kw)

    module.test_loss = traced
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            final = module.train(
                dataset,
                enc,
                encs,
                dec,
                decs,
                200,
                6,
                1,
                torch.device("cpu"),
                {"fed": fed, "space": "sigmoid"},
            )
    finally:
        module.test_loss = test_loss
    curve = [float(v) for v in re.findall(r"Avg test loss: ([0-9.eE+-]+)", printed.getvalue())]
    flips = np.flatnonzero(np.diff(np.sign(w1)))
    return {
        "final": float(final),  # their test_loss already reports 50·MSE(s/50)
        "curve": curve,
        "start": start,
        "final_w1": w1[-1],
        "last_flip": int(flips[-1] + 1) if len(flips) else 0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="checkout of UMDataScienceLab/Personalized_FL_with_DA")
    parser.add_argument(
        "--data", default=str(DEFAULT_DATA), help="folder with FL_Dataset_Printer*_Speed*.csv"
    )
    parser.add_argument("--fed", choices=list(METHODS), default="Ditto")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--ours", action="store_true", help="start from this project's parameters for each seed"
    )
    args = parser.parse_args(argv)
    repo, data = Path(args.repo), Path(args.data)
    if not (repo / "printer_dataset" / "printer.py").is_file():
        parser.exit(2, f"no printer_dataset/printer.py under {repo}\n")
    if not data.is_dir():
        parser.exit(2, f"printer data folder {data} not found\n")
    try:
        module = load_printer_module(repo)
    except (ValueError, ImportError) as exc:
        parser.exit(2, f"{exc}\n")
    finals = []
    for seed in args.seeds:
        r = run_seed(module, data, args.fed, seed, args.ours)
        finals.append(r["final"])
        s = r["start"]
        shown = " / ".join(f"{r['curve'][t - 1]:.3g}" for t in SHOW)
        print(
            f"seed {seed}: final {r['final']:.3f}; start a0 {s['a0']:+.3f} w1 {s['w1']:+.3f} w2 {s['w2']:+.3f}; "
            f"final w1 {r['final_w1']:+.3f}; w1 last changed sign after round {r['last_flip'] or 'never'}; "
            f"test loss at rounds {', '.join(map(str, SHOW))}: {shown}",
            flush=True,
        )
    f = np.array(finals)
    far = [s for s, v in zip(args.seeds, f, strict=True) if v > 0.5]
    sd = f.std(ddof=1) if len(f) > 1 else 0.0
    print(
        f"{len(f)} seeds: mean {f.mean():.3f} ± {sd:.3f} (sample sd), median {np.median(f):.3f}; far off (> 0.5): {far}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

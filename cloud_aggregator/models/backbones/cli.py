"""``cloud-aggregator backbone train | export``: parsers and handlers.

The cloud trains its backbones here and uses :mod:`export` as its library (torch →
ONNX, checks, manifest, signature, package).  torch is imported only inside the two
handlers: the rest of ``cloud-aggregator`` (``serve``, ``push``, ``fleet``) must start
on a machine without torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from cloud_aggregator.models.backbones.data import build_data
from cloud_aggregator.store.sqlite import SqliteStore
from export.keys import load_private_key
from export.package import PARITY_TOLERANCE, ExportError
from ioft_protocol.manifest import ManifestError
from sensors.features.schema import SCHEMA_HASH_KEY, schema_metadata
from sensors.sim.vibration import WINDOW_SCHEMA
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

#: The simulator data set whose held-out split stands for a schema's rows (data the cloud may hold).
SCHEMA_DATA = {"weld-dwt": "weld-features", "printer-window": "printer-windows"}


def _kv(items: list[str]) -> dict[str, object]:
    """``["n_printers=24", "seed=1"]`` → ``{"n_printers": 24, "seed": 1}`` (values parsed as JSON when they can be)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _train(args: argparse.Namespace) -> int:
    # torch: only this command and `export` need it (see the module docstring).
    from cloud_aggregator.models.backbones.train import TrainSettings, train_backbone

    try:
        settings = TrainSettings(
            backbone=args.backbone,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            data_args=_kv(args.data_arg),
        )
        result = train_backbone(
            settings, args.out, device=args.device, progress=not args.no_progress, threads=args.threads
        )
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    final = result.history[-1] if result.history else {}
    print(json.dumps({"run": str(result.out_dir), **final}, sort_keys=True))
    return 0


def _schema_metadata(name: str) -> dict[str, str]:
    """The ONNX metadata naming input schema ``name`` (``weld-dwt`` or ``printer-window``)."""
    if name == "weld-dwt":
        return schema_metadata()
    if name == "printer-window":
        return {
            SCHEMA_HASH_KEY: WINDOW_SCHEMA.schema_hash(),
            "ioft.window_schema.json": WINDOW_SCHEMA.to_json(),
        }
    raise ValueError(f"unknown schema {name!r}; choose 'weld-dwt' or 'printer-window'")


def _heldout(choice: str, schema: str) -> tuple[np.ndarray | None, str]:
    """``(rows or None, description)`` for ``export --task --heldout``: the schema's simulator
    held-out split, rows from a ``.npy`` file, or ``synthetic`` (seeded standard-normal rows)."""
    if choice == "synthetic":
        return None, "synthetic-normal"
    if choice == "schema":
        if schema not in SCHEMA_DATA:
            raise ValueError(f"unknown schema {schema!r}; choose one of {sorted(SCHEMA_DATA)}")
        data = build_data(SCHEMA_DATA[schema])
        return data.x_test, f"heldout: {data.description} (test split)"
    rows = np.load(choice, allow_pickle=False)
    if rows.dtype.kind not in "fiu" or rows.ndim < 2 or len(rows) == 0:
        raise ValueError(
            f"{choice}: expected a non-empty numeric array of rows, got {rows.dtype} {rows.shape}"
        )
    return rows.astype(np.float32), f"heldout: {Path(choice).name}"


def _task_params(args: argparse.Namespace) -> tuple[Params, TaskSpec]:
    """The final global parameters and spec of ``--task`` from the aggregator's store."""
    db = Path(args.store)
    if not db.exists():
        raise FileNotFoundError(f"no aggregator store at {db}")
    store = SqliteStore(db, readonly=True)
    try:
        specs = store.tasks()
        if args.task not in specs:
            raise ValueError(f"task {args.task!r} not in {db}; it has {sorted(specs)}")
        point = store.resume_point(args.task)
    finally:
        store.close()
    if point is None:
        raise ValueError(f"task {args.task!r} has no completed round yet")
    return point[2], TaskSpec.from_json(specs[args.task])


def _export(args: argparse.Namespace) -> int:
    # torch: only this command and `backbone train` need it (see the module docstring).
    from cloud_aggregator.models.backbones.packaging import export_params, export_run

    try:
        key = load_private_key(args.key)
        if args.run is not None:
            summary = export_run(
                args.run,
                args.out,
                name=args.name,
                version=args.version,
                key=key,
                output=args.output,
                quantize=args.quantize,
                opset=args.opset,
                tolerance=args.parity_tolerance,
            )
        else:
            params, spec = _task_params(args)
            heldout, described = _heldout(args.heldout, args.schema)
            summary = export_params(
                params,
                args.out,
                model=spec.model,
                model_args=spec.model_args,
                blocks=args.blocks,
                prefix=args.prefix,
                schema_metadata=_schema_metadata(args.schema),
                name=args.name,
                version=args.version,
                key=key,
                heldout=heldout,
                heldout_description=described,
                quantize=args.quantize,
                opset=args.opset,
                tolerance=args.parity_tolerance,
                extra={"task": spec.name},
            )
    except (ExportError, ManifestError, ValueError, KeyError, FileNotFoundError) as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 1
    print(summary.report)
    print(f"package: {summary.package.manifest_path} + {summary.package.onnx_path.name}")
    return 0


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``backbone train`` and ``export`` to the ``cloud-aggregator`` subcommands."""
    b = sub.add_parser("backbone", help="cloud backbones in torch")
    bsub = b.add_subparsers(dest="backbone_command", required=True)
    t = bsub.add_parser("train", help="train (or resume) a backbone run in a folder")
    t.add_argument("--backbone", required=True, choices=["printer-cnn", "weld-mlp"])
    t.add_argument("--out", type=Path, required=True, help="run folder (checkpoint, data, summary)")
    t.add_argument("--epochs", type=int, default=30)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto", help="auto (GPU when present), cpu, cuda, cuda:1 ...")
    t.add_argument(
        "--data-arg", action="append", default=[], help="KEY=VALUE for the data builder, e.g. n_printers=24"
    )
    t.add_argument("--threads", type=int, help="torch CPU threads (default: one per core)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=_train)

    e = sub.add_parser("export", help="ONNX export (checked, parity-tested), optional int8, signed manifest")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=Path, help="a `backbone train` run folder")
    src.add_argument("--task", help="a federated task's final global parameters (with --store)")
    e.add_argument("--store", type=Path, help="the aggregator's aggregator.sqlite (for --task)")
    e.add_argument("--blocks", nargs="+", help="leading model blocks to export (for --task), e.g. fc0 relu0")
    e.add_argument("--prefix", default="", help="strip this prefix from parameter names first (for --task)")
    e.add_argument(
        "--schema", default="weld-dwt", help="input schema of --task's data: weld-dwt | printer-window"
    )
    e.add_argument(
        "--heldout",
        default="schema",
        help="rows --task's parity check runs on: 'schema' (the schema's simulator held-out split, "
        "the default), ROWS.npy (e.g. lab recordings), or 'synthetic' (standard-normal rows)",
    )
    e.add_argument("--name", required=True, help="model name devices know it by, e.g. weld-encoder")
    e.add_argument("--version", type=int, required=True, help="increases with every push of this name")
    e.add_argument("--key", type=Path, required=True, help="the fleet's private key (keygen)")
    e.add_argument("--out", type=Path, required=True, help="folder for the package")
    e.add_argument("--output", default="embedding", choices=["embedding", "logits", "regression"])
    e.add_argument("--quantize", action="store_true", help="package the int8 dynamic-quantized variant")
    e.add_argument("--opset", type=int, default=17)
    e.add_argument(
        "--parity-tolerance",
        type=_positive_float,
        default=PARITY_TOLERANCE,
        help="largest |onnxruntime - torch| on held-out rows, relative to max(1, the outputs' largest "
        "magnitude) (default: %(default)g)",
    )
    e.set_defaults(func=_export)

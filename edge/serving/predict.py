"""``edge-trainer predict --config device.toml ROWS_OR_WELD_FILE``: one-off answers from the serving models.

The input is a weld file (``.wav``, ``.npy`` or ``.csv`` with its optional sidecar, as the
watched folder takes them: its 624 DWT features are extracted here) or a JSON-lines file of
rows, one object a line: ``{"x": [...]}`` (features as the dataset stores them) or, for a
printer, ``{"sigma_a": 0.8, "speed": 40}``; ``key``, ``kind`` and ``schema_hash`` are optional.
Each answer is printed as one JSON line; ``--advice`` prints each printer task's speed advice
under ``[serve] vibration_budget`` (or ``--budget``) instead, and needs no input.  Bad input, or a row no serving model takes, is one
line on stderr and exit status 2.  The running daemon is not involved: the models are read
from ``<state_dir>/serving/`` (written there after each round the gate let through).

The input may be a file someone else wrote, so it is read as :mod:`sensors.files` reads
untrusted files: a symbolic link is refused, not followed (a link could point at the device's
keys, which are regular files, so resolving it and checking the target would not do); a
directory, ``/dev/null`` or a pipe is named as what it is; a file over ``[serve] max_file_bytes``
(or a weld whose header declares more) is refused before anything is allocated; and no error
quotes the file's contents (a line that is not JSON is named by its number only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from edge.config import DeviceConfig, resolve_relative_files
from edge.rows import Row
from edge.serving.advice import ceilings, speed_advice
from edge.serving.model import Refused, ServingModel
from edge.serving.offers import model_path
from ioft_protocol.config import build, load_toml
from sensors.files import FileRefusedError, printable, read_capped
from sensors.welding.formats import WELD_SUFFIXES


class PredictError(ValueError):
    """Input or state ``predict`` cannot answer from (one line, exit status 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("command", choices=["predict"])
    p.add_argument(
        "--config", type=Path, required=True, help="the device's TOML (the one edge-trainer runs with)"
    )
    p.add_argument("--device", help="this device's id (default: the config's `device`)")
    p.add_argument("--state-dir", help="the daemon's state folder (default: the config's)")
    p.add_argument(
        "--task", action="append", help="answer for this task only (repeatable; default: every serving task)"
    )
    p.add_argument(
        "--advice",
        action="store_true",
        help="print each printer task's speed advice (the highest speed its model keeps within the "
        "vibration budget) instead of answering rows",
    )
    p.add_argument(
        "--budget", type=float, help="with --advice: the budget, > 0 (default: [serve] vibration_budget)"
    )
    p.add_argument(
        "input", type=Path, nargs="?", help="a weld file (.wav/.npy/.csv) or a JSON-lines file of rows"
    )


def read_rows(path: Path, max_bytes: int) -> list[Row]:
    """The rows of ``path`` (see the module docstring); ``PredictError`` names the first bad line."""
    if path.suffix.lower() in WELD_SUFFIXES:
        return [weld_row(path, max_bytes)]  # read as untrusted by the weld readers
    try:
        data = read_capped(path, max_bytes, setting="[serve] max_file_bytes")
    except FileRefusedError as exc:
        raise PredictError(str(exc)) from None
    rows = []
    now = time.time()
    shown = printable(path)
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if "x" not in d and "sigma_a" in d:
                d = {**d, "x": [d["sigma_a"]], "commanded": d.get("speed")}
            schema = d.get("schema_hash")
            d = {
                "kind": d.get("kind", "weld" if schema else "layer"),
                "key": str(d.get("key", f"{path.name}:{n}")),
                "time": now,
                **{k: d[k] for k in ("x", "commanded", "schema_hash") if d.get(k) is not None},
            }
            rows.append(Row.from_json(json.dumps(d)))
        except (ValueError, KeyError, TypeError) as exc:
            raise PredictError(
                f'{shown} line {n}: {_what_is_wrong(exc)}; each line must be a JSON object with "x": '
                '[features] or, for a printer, "sigma_a" and "speed"'
            ) from None
    if not rows:
        raise PredictError(f"{shown}: no rows in it")
    return rows


def _what_is_wrong(exc: Exception) -> str:
    """What is wrong with a line, without quoting it (the file may hold anything: a key, a password)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON ({exc.msg} at column {exc.colno})"
    if isinstance(exc, ValueError):  # the row checks name the field; a ", got <value>" is cut off
        return str(exc).split(", got")[0]
    return f"not a row this device takes ({type(exc).__name__})"


def weld_row(path: Path, max_bytes: int) -> Row:
    """One weld file's features, extracted as the recorder extracts them."""
    from sensors.features.pipeline import labelled_rows
    from sensors.welding.formats import read_weld_file
    from sensors.welding.recording import WeldDataError

    try:
        rows = list(labelled_rows([read_weld_file(path, max_bytes=max_bytes)], None, on_error="raise"))
    except (WeldDataError, OSError) as exc:
        # the reader's messages name the file, never its contents; printable keeps them one line
        raise PredictError(printable(f"not a weld this device can read: {exc}")) from None
    except MemoryError:
        raise PredictError(
            f"{printable(path)}: too large to decode in this device's free memory; "
            "lower [serve] max_file_bytes"
        ) from None
    r = rows[0]
    return Row("weld", r.weld_id, time.time(), tuple(r.features.tolist()), schema_hash=r.schema_hash)


def serving_models(config: DeviceConfig, tasks: list[str] | None) -> dict[str, ServingModel]:
    """The serving models saved in the device's state folder (only this device's, only these tasks)."""
    folder = model_path(Path(config.state_dir), "x").parent
    names = tasks or sorted(p.name.removesuffix(".safetensors") for p in folder.glob("*.safetensors"))
    if config.serve.tasks:
        names = [t for t in names if t in config.serve.tasks]
    models = {}
    for task in names:
        try:
            model = ServingModel.load(
                model_path(Path(config.state_dir), task), device=config.device, task=task
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise PredictError(str(exc)) from None
        if model is not None:
            models[task] = model
    if not models:
        which = f"task {', '.join(tasks)}" if tasks else "any task"
        raise PredictError(
            f"no serving model for {which} in {folder}: edge-trainer writes one after each round this "
            "device takes part in (is this the device's config, and has it trained a round?)"
        )
    return models


def encoder_lookup(config: DeviceConfig):
    """``name -> active ONNX model`` from the device's model folder (``None`` without ``[model]``)."""
    if not config.model.public_key:
        return lambda _name: None
    from edge.models.manager import ModelManager
    from ioft_protocol.manifest import load_public_key

    manager = ModelManager(
        Path(config.state_dir) / "models",
        config.model,
        device=config.device,
        fleet=config.fleet,
        public_key=load_public_key(config.model.public_key),
        data_schema_hash=None,
        holdout=None,
        subscribe=lambda _t: None,
        unsubscribe=lambda _t: None,
    )
    return manager.active


def run(args: argparse.Namespace) -> int:
    """Print one JSON answer per row and serving task; ``PredictError`` for what cannot be answered."""
    raw = resolve_relative_files(load_toml(args.config), args.config.parent)
    device = args.device or raw.get("device")
    if not device:
        raise PredictError(f"{args.config} names no device: give --device")
    raw["device"] = device
    if args.state_dir:
        raw["state_dir"] = args.state_dir
    raw.setdefault("state_dir", f"/var/lib/ioft/{device}")
    config = build(DeviceConfig, raw, str(args.config))
    if args.advice:
        return print_advice(config, args)
    if args.input is None:
        raise PredictError("give a weld file or a JSON-lines file of rows to answer (or --advice)")
    rows = read_rows(args.input, config.serve.max_file_bytes)
    models = serving_models(config, args.task)
    encoder = encoder_lookup(config)
    for row in rows:
        for task, model in models.items():
            try:
                enc = encoder(model.encoder) if model.encoder else None
                ans = model.answer(row, enc, coverage=config.serve.coverage)
            except Refused as exc:
                raise PredictError(
                    f"row {row.key}: task {task} gives no answer ({exc.reason.value}): {exc}"
                ) from None
            print(ans.encode().decode(), flush=True)
    return 0


def print_advice(config: DeviceConfig, args: argparse.Namespace) -> int:
    """``--advice``: one JSON line per printer task with the speed its serving model advises."""
    if args.budget is not None and not 0 < args.budget < math.inf:
        # refused, not read as "no budget": a sign slip would otherwise blame the config
        raise PredictError(
            f"--budget must be a positive number (in the units of sigma_a), got {args.budget:g}"
        )
    budget = args.budget if args.budget is not None else config.serve.vibration_budget
    if budget is None:
        raise PredictError(
            "no vibration budget: give --budget (in the units of sigma_a) or set [serve] vibration_budget"
        )
    printed = 0
    for task, model in serving_models(config, args.task).items():
        if model.classes is not None:
            continue
        advice = speed_advice(model, budget, config.serve.min_advice,
                              ceiling=ceilings(model, config.serve.max_advice, None))  # fmt: skip
        ident = {k: v for k, v in dataclasses.asdict(model.identity).items() if v is not None}
        body = {"device": config.device, "task": task, "model": ident,
                "advice": {**advice.to_dict(), "vibration_budget": budget}}  # fmt: skip
        print(json.dumps(body, separators=(",", ":")), flush=True)
        printed += 1
    if not printed:
        raise PredictError("no serving model here predicts a printer's speed: advice is for printers")
    return 0

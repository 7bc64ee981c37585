"""onnxruntime vs torch eager for each cloud backbone's encoder, float32 vs int8, side by side.

For each backbone (``printer-cnn`` over raw 2x256 vibration windows, ``weld-mlp``
over 624 DWT features) this trains a run on the simulators, exports the encoder
(float32, and int8 dynamic), and times torch eager and onnxruntime at batch 1 and
64 — interleaved round-robin, one thread each (what a Pi core gives one daemon),
so load from other processes hits every contender alike.  It also reports file
sizes and the task score through the trained head (accuracy or R²) on held-out data
for float32 and int8.  Target: onnxruntime >= 2x faster than torch at batch 1.

    python -m benchmarks.onnx_inference [--quick]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import markdown_table, study_parser, write_result

BACKBONES = {
    # backbone: (data args, epochs) full / quick
    "printer-cnn": (({"n_printers": 24}, 15), ({"n_printers": 4}, 3)),
    "weld-mlp": (({"n_per_domain": 60}, 40), ({"n_per_domain": 12}, 10)),
}


def interleaved_ms(fns: dict[str, object], repeats: int, warmup: int = 20) -> dict[str, float]:
    """Median ms per call of each function, timed round-robin so contention is shared."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def bench_backbone(name: str, quick: bool, work: Path, key, repeats: int) -> dict[str, object]:
    import torch

    from cloud_aggregator.models.backbones.packaging import export_run
    from cloud_aggregator.models.backbones.train import TrainSettings, load_run, train_backbone
    from export.runtime import ort_session

    data_args, epochs = BACKBONES[name][1 if quick else 0]
    run = work / name
    started = time.perf_counter()
    train_backbone(TrainSettings(name, epochs=epochs, data_args=data_args), run, device="cpu", threads=1)
    train_s = time.perf_counter() - started
    fp32 = export_run(run, work / "pkg", name=f"{name}-enc", version=1, key=key)
    int8 = export_run(run, work / "pkg", name=f"{name}-enc", version=2, key=key, quantize=True)
    model, data, _, _ = load_run(run)
    encoder = model.encoder.eval()
    torch.set_num_threads(1)
    sessions = {
        "fp32": ort_session(fp32.package.onnx_path, 1),
        "int8": ort_session(int8.package.onnx_path, 1),
    }
    out: dict[str, object] = {
        "backbone": name,
        "params": sum(p.numel() for p in encoder.parameters()),
        "input": "x".join(str(d) for d in data.input_shape),
        "train_s": train_s,
        "parity": fp32.export.parity_max_abs_diff,
        "size_fp32": fp32.package.manifest.size,
        "size_int8": int8.package.manifest.size,
        "score_name": fp32.variants[0].score_name,
        "score_fp32": fp32.variants[0].score,
        "score_int8": int8.variants[1].score,
    }
    for batch in (1, 64):
        x = np.ascontiguousarray(np.resize(data.x_test, (batch, *data.input_shape)), dtype=np.float32)
        xt = torch.from_numpy(x)

        def eager(xt=xt):
            with torch.inference_mode():
                encoder(xt)

        feed = {"x": x}
        fns = {
            "torch": eager,
            "ort_fp32": lambda feed=feed: sessions["fp32"].run(None, feed),
            "ort_int8": lambda feed=feed: sessions["int8"].run(None, feed),
        }
        for label, ms in interleaved_ms(fns, repeats if batch == 1 else max(50, repeats // 4)).items():
            out[f"{label}_b{batch}"] = ms
    return out


def latency_only(repeats: int) -> str:
    """Untrained encoders (latency does not depend on the weights): torch eager vs onnxruntime float32.

    Needs only torch, onnx, onnxruntime and NumPy, so it runs on a box without the rest
    of the stack (e.g. a quiet many-core host, or a Pi with a torch wheel for the comparison).
    """
    import io

    import onnxruntime as ort
    import torch

    from cloud_aggregator.models.backbones.nets import FeatureMLP, VibrationCNN

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    encoders = {
        "printer-cnn": (VibrationCNN(), (2, 256)),
        "weld-mlp": (FeatureMLP(rng.normal(size=624), rng.uniform(0.5, 2, 624)), (624,)),
    }
    rows = []
    for name, (module, shape) in encoders.items():
        module.eval()
        buf = io.BytesIO()
        torch.onnx.export(module, (torch.zeros(1, *shape),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["z"], dynamic_axes={"x": {0: "b"}, "z": {0: "b"}})  # fmt: skip
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
        session = ort.InferenceSession(buf.getvalue(), options, providers=["CPUExecutionProvider"])
        row = [name, sum(p.numel() for p in module.parameters())]
        for batch in (1, 64):
            x = rng.normal(size=(batch, *shape)).astype(np.float32)
            xt = torch.from_numpy(x)

            def eager(xt=xt, module=module):
                with torch.inference_mode():
                    module(xt)

            def run(x=x, session=session):
                session.run(None, {"x": x})

            ms = interleaved_ms(
                {"torch": eager, "ort": run}, repeats if batch == 1 else max(50, repeats // 4)
            )
            row += [f"{ms['torch']:.4f}", f"{ms['ort']:.4f}", f"{ms['torch'] / ms['ort']:.1f}x"]
        rows.append(row)
    import platform

    headers = ["backbone", "encoder params", "torch b1 (ms)", "ORT b1 (ms)", "speed-up b1", "torch b64 (ms)",
               "ORT b64 (ms)", "speed-up b64"]  # fmt: skip
    return (
        f"Latency only (untrained weights, one thread each), torch {torch.__version__}, onnxruntime "
        f"{ort.__version__}, {platform.machine()} with {__import__('os').cpu_count()} CPUs:\n\n"
        + markdown_table(headers, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0,))
    parser.add_argument("--repeats", type=int, default=1000, help="timed calls per contender at batch 1")
    parser.add_argument(
        "--latency-only", action="store_true", help="untrained encoders; torch+onnxruntime only"
    )
    args = parser.parse_args(argv)
    if args.latency_only:
        print(latency_only(args.repeats))
        return 0
    from export.keys import generate_keypair, load_private_key

    rows = []
    with tempfile.TemporaryDirectory(prefix="ioft-onnx-bench-") as tmp:
        work = Path(tmp)
        key = load_private_key(generate_keypair(work / "fleet.key")[0])
        for name in BACKBONES:
            rows.append(bench_backbone(name, args.quick, work, key, args.repeats))
    import os

    load = os.getloadavg()
    lat = markdown_table(
        ["backbone", "encoder params", "input", "torch b1 (ms)", "ORT fp32 b1 (ms)", "ORT int8 b1 (ms)",
         "ORT speed-up b1", "target >= 2x", "torch b64 (ms)", "ORT fp32 b64 (ms)", "ORT int8 b64 (ms)",
         "ORT speed-up b64"],
        [[r["backbone"], r["params"], r["input"], f"{r['torch_b1']:.4f}", f"{r['ort_fp32_b1']:.4f}",
          f"{r['ort_int8_b1']:.4f}", f"{r['torch_b1'] / r['ort_fp32_b1']:.1f}x",
          "met" if r["torch_b1"] / r["ort_fp32_b1"] >= 2 else "NOT met", f"{r['torch_b64']:.3f}",
          f"{r['ort_fp32_b64']:.3f}", f"{r['ort_int8_b64']:.3f}", f"{r['torch_b64'] / r['ort_fp32_b64']:.1f}x"]
         for r in rows],
    )  # fmt: skip
    size = markdown_table(
        ["backbone", "float32 (KiB)", "int8 (KiB)", "size ratio", "held-out score float32", "int8", "change",
         "parity max abs diff (fp32 vs torch)", "training (s)"],
        [[r["backbone"], f"{r['size_fp32'] / 1024:.1f}", f"{r['size_int8'] / 1024:.1f}",
          f"{r['size_int8'] / r['size_fp32']:.2f}", f"{r['score_name']} {r['score_fp32']:.4f}",
          f"{r['score_int8']:.4f}", f"{r['score_int8'] - r['score_fp32']:+.4f}", f"{r['parity']:.2g}",
          f"{r['train_s']:.0f}"] for r in rows],
    )  # fmt: skip
    body = (
        "Latency: median of interleaved calls, one intra-op thread for torch and onnxruntime alike, "
        f"on the encoder only (the device's part). Load average while measuring: {load[0]:.1f} "
        "(other work shares this machine; interleaving spreads it over every contender).\n\n"
        f"{lat}\n\nSize and task score (through the trained head, held-out data):\n\n{size}\n"
    )
    print(body)
    if not args.no_write:
        path = write_result("onnx_inference" + ("_quick" if args.quick else ""), body)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

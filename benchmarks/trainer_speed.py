"""trainer_lite vs torch on CPU: training steps per second and peak RSS, side by side.

Each framework runs in its own worker process, so the RSS figures are honest: the
trainer_lite worker imports only NumPy and trainer_lite (what a Pi runs), the torch
workers import torch.  Workers stay alive and the parent asks them in turn for
short timed bursts of training, round-robin, so a noisy neighbour slows every
framework alike instead of whichever happened to run at that moment.

A step is one minibatch of an epoch-shuffled dataset, forward, loss, backward and
optimizer step, float32 on both sides, as ``trainer_lite.algorithms.fedavg.run_local_steps``
runs it on a device.  Thread settings: trainer_lite with NumPy's default BLAS
threads and with ``OPENBLAS_NUM_THREADS=1``; torch with its default threads and
with ``torch.set_num_threads(1)``.

Run ``python -m benchmarks.trainer_speed --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

# Only the standard library at module level: a worker imports its framework itself.

# name -> settings shared by both frameworks (the two sizes first).
_GLM = {"batch": 32, "n": 320, "d_in": 1, "loss": "mse", "lr": 3e-3, "wd": 3e-4}  # PFL-DA's Adam
MODELS: dict[str, dict[str, Any]] = {
    "ftl_mlp": {
        "desc": "FTL-TP MLP 624-175-125-50-4, ReLU, Kaiming",
        **{"batch": 8, "n": 800, "d_in": 624, "classes": 4, "loss": "cross_entropy", "lr": 5e-4, "wd": 0.0},
    },
    "sigmoid_glm": {"desc": "PFL-DA sigmoid GLM (φ1·x+φ2, g1·σ+g2)", **_GLM},
    "gaussian_glm": {"desc": "PFL-DA Gaussian GLM, authors' form (16 bumps, 16-1024-1)", **_GLM},
    "printer_nn": {"desc": "PFL-DA authors' NN (1→128 residual encoder, 5×128 decoder)", **_GLM},
}
DEFAULT_MODELS = ["ftl_mlp", "sigmoid_glm"]

# worker name -> (framework, extra environment)
WORKERS: dict[str, tuple[str, dict[str, str]]] = {
    "trainer_lite": ("trainer_lite", {}),
    "trainer_lite 1 thread": ("trainer_lite", {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}),
    "torch": ("torch", {}),
    "torch 1 thread": ("torch1", {}),
}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# -- workers -----------------------------------------------------------------------------
def _problem(name: str, seed: int) -> tuple[Any, dict[str, Any], Any, Any, Any]:
    """trainer_lite model, float32 initial parameters, data and the generator that shuffles it.

    Both frameworks start from these (NumPy only), so they train the same weights on
    the same batches in the same order and their losses can be compared.
    """
    import numpy as np

    from trainer_lite.models import build_model, mlp

    cfg = MODELS[name]
    rng = np.random.default_rng(seed)
    model = mlp([624, 175, 125, 50, 4], init="kaiming") if name == "ftl_mlp" else build_model(name)
    params = model.init(rng, dtype=np.float32)
    if cfg["loss"] == "cross_entropy":
        x = rng.normal(size=(cfg["n"], cfg["d_in"])).astype(np.float32)
        y = rng.integers(0, cfg["classes"], cfg["n"])
    else:
        x = rng.uniform(0.2, 2.2, size=(cfg["n"], 1)).astype(np.float32)
        y = rng.uniform(0.2, 1.0, size=(cfg["n"], 1)).astype(np.float32)
    return model, params, x, y, rng


class _TrainerLiteRunner:
    """Trains with trainer_lite: the loop of ``run_local_steps``, written out so the
    benchmark does not depend on the algorithm modules being importable."""

    def __init__(self, name: str, seed: int) -> None:
        from trainer_lite.data import Dataset, minibatches
        from trainer_lite.losses import cross_entropy, mse
        from trainer_lite.optim import Adam

        cfg = MODELS[name]
        self.model, self.params, x, y, self.rng = _problem(name, seed)
        self.loss = cross_entropy if cfg["loss"] == "cross_entropy" else mse
        self.data = Dataset(x, y)
        self.batch = cfg["batch"]
        self.opt = Adam(cfg["lr"], weight_decay=cfg["wd"])
        self.names = self.model.param_names()
        self._minibatches = minibatches
        self.n_params = sum(int(v.size) for v in self.params.values())

    def run(self, steps: int) -> float:
        """``steps`` training steps; returns the mean loss (read each step, as a device logs it)."""
        model, params, loss, opt, names = self.model, self.params, self.loss, self.opt, self.names
        total, done = 0.0, 0
        while done < steps:
            for batch in self._minibatches(self.data, self.batch, self.rng):
                pred, cache = model.forward(params, batch.x)
                value, dpred = loss(pred, batch.y)
                grads = model.param_grads(params, cache, dpred)
                opt.step(params, {n: grads[n] for n in names})
                total += value
                done += 1
                if done == steps:
                    break
        return total / steps


class _TorchRunner:
    """The same model, weights, data and batch order in idiomatic eager torch (float32, CPU)."""

    def __init__(self, name: str, seed: int) -> None:
        import torch
        from torch import nn

        cfg = MODELS[name]
        self.torch = torch
        tl_model, params, x, y, self.rng = _problem(name, seed)
        self.model = _torch_model(name)
        with torch.no_grad():
            for tparam, value in _torch_params(name, self.model, params):
                tparam.copy_(torch.from_numpy(value.copy()).reshape(tparam.shape))
            # The two must compute the same function before either trains.
            ours = tl_model(params, x[:16])
            theirs = self.model(torch.from_numpy(x[:16])).numpy()
            if ours.shape != theirs.shape or not (abs(ours - theirs) <= 1e-4 * (1 + abs(ours))).all():
                raise RuntimeError(
                    f"torch {name} does not reproduce trainer_lite's outputs; fix _torch_params"
                )
        self.x = torch.from_numpy(x)
        self.y = torch.from_numpy(y)
        self.loss = nn.functional.cross_entropy if cfg["loss"] == "cross_entropy" else nn.functional.mse_loss
        self.batch = cfg["batch"]
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"])
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def run(self, steps: int) -> float:
        torch, model, loss_fn, opt = self.torch, self.model, self.loss, self.opt
        n = len(self.x)
        total, done = 0.0, 0
        while done < steps:
            # The same NumPy permutation trainer_lite's minibatches draws.
            order = torch.from_numpy(self.rng.permutation(n))
            for start in range(0, n, self.batch):
                idx = order[start : start + self.batch]
                opt.zero_grad()
                loss = loss_fn(model(self.x[idx]), self.y[idx])
                loss.backward()
                opt.step()
                total += loss.item()
                done += 1
                if done == steps:
                    break
        return total / steps


def _torch_params(name: str, model: Any, p: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(torch parameter, trainer_lite array) pairs; torch stores Linear weights transposed."""

    def linear(mod: Any, prefix: str) -> list[tuple[Any, Any]]:
        return [(mod.weight, p[prefix + "weight"].T), (mod.bias, p[prefix + "bias"])]

    if name == "ftl_mlp":
        return [pair for i in range(4) for pair in linear(model[2 * i], f"fc{i}.")]
    enc = (
        [(model.enc.weight, p["encoder.scale"]), (model.enc.bias, p["encoder.shift"])]
        if name != "printer_nn"
        else []
    )
    if name == "sigmoid_glm":
        return enc + linear(model.dec, "decoder.")
    if name == "gaussian_glm":
        rbf = [(model.centers, p["decoder.rbf.centers"]), (model.stds, p["decoder.rbf.stds"])]
        return enc + rbf + linear(model.fc1, "decoder.fc1.") + linear(model.fc2, "decoder.fc2.")
    pairs = linear(model.sc, "encoder.shortcut.") + linear(model.body[0], "encoder.body.fc0.")
    pairs += linear(model.body[2], "encoder.body.fc1.")
    return pairs + [pair for i in range(5) for pair in linear(model.dec[2 * i], f"decoder.fc{i}.")]


def _torch_model(name: str) -> Any:
    import torch
    from torch import nn

    if name == "ftl_mlp":
        return nn.Sequential(
            nn.Linear(624, 175), nn.ReLU(), nn.Linear(175, 125), nn.ReLU(), nn.Linear(125, 50), nn.ReLU(),
            nn.Linear(50, 4),
        )  # fmt: skip

    class SigmoidGLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.dec = nn.Linear(1, 1), nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dec(torch.sigmoid(self.enc(x)))

    class GaussianGLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(1, 1)
            self.centers = nn.Parameter(torch.rand(16))
            self.stds = nn.Parameter(torch.ones(16))
            self.fc1, self.fc2 = nn.Linear(16, 1024), nn.Linear(1024, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            phi = torch.exp(-((self.centers - self.enc(x)) ** 2) * (0.5 * self.stds**2))
            return self.fc2(self.fc1(phi))

    class PrinterNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sc = nn.Linear(1, 128)
            self.body = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 128))
            layers: list[nn.Module] = []
            for i in range(5):
                layers.append(nn.Linear(128, 128 if i < 4 else 1))
                if i < 4:
                    layers.append(nn.ReLU())
            self.dec = nn.Sequential(*layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dec(self.sc(x) + self.body(x))

    return {"sigmoid_glm": SigmoidGLM, "gaussian_glm": GaussianGLM, "printer_nn": PrinterNN}[name]()


def worker_main(framework: str, models: list[str], seed: int) -> None:
    """Serve timing requests on stdin/stdout, one JSON object per line."""
    out = sys.stdout
    if framework == "trainer_lite":
        import numpy  # counted in the import RSS, as on a device

        import trainer_lite.data
        import trainer_lite.losses
        import trainer_lite.models
        import trainer_lite.optim  # noqa: F401

        runner_cls: Any = _TrainerLiteRunner
        threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
        version = f"numpy {numpy.__version__}"
    else:
        import torch

        if framework == "torch1":
            torch.set_num_threads(1)
        runner_cls = _TorchRunner
        threads = str(torch.get_num_threads())
        version = f"torch {torch.__version__}"
    import_rss = _rss_mib()
    runners = {m: runner_cls(m, seed) for m in models}
    hello = {
        "version": version,
        "import_rss_mib": import_rss,
        "threads": threads,
        "n_params": {m: r.n_params for m, r in runners.items()},
    }
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "run":
            runner = runners[req["model"]]
            t0 = time.perf_counter()
            loss = runner.run(req["steps"])
            elapsed = time.perf_counter() - t0
            reply: dict[str, Any] = {"elapsed": elapsed, "loss": loss}
        else:  # "finish"
            reply = {
                "peak_rss_mib": _rss_mib(),
                "torch_loaded": "torch" in sys.modules,
                "numpy_loaded": "numpy" in sys.modules,
            }
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if req["cmd"] == "finish":
            return


# -- parent ------------------------------------------------------------------------------
class _Worker:
    def __init__(self, label: str, framework: str, env: dict[str, str], models: list[str], seed: int) -> None:
        self.label = label
        full_env = {**os.environ, **env}
        cmd = [sys.executable, "-m", "benchmarks.trainer_speed", "--worker", framework, "--seed", str(seed)]
        cmd += ["--models", *models]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=full_env, bufsize=1
        )
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(
                f"worker {self.label!r} exited early (code {self.proc.wait()}); see its stderr above "
                "(the torch workers need torch: pip install -e '.[cloud]')"
            )
        return json.loads(line)

    def ask(self, **req: Any) -> dict[str, Any]:
        stdin = self.proc.stdin
        if stdin is None:
            raise RuntimeError(f"worker {self.label!r} has no stdin pipe")
        stdin.write(json.dumps(req) + "\n")
        stdin.flush()
        return self._read()

    def finish(self) -> dict[str, Any]:
        reply = self.ask(cmd="finish")
        self.proc.wait(timeout=60)
        return reply


def measure(models: list[str], repeats: int, burst_s: float, pause_s: float, seed: int) -> dict[str, Any]:
    """Start the workers, time round-robin bursts, collect RSS; raw numbers per worker and model."""
    from benchmarks.common import progress

    workers = [_Worker(label, fw, env, models, seed) for label, (fw, env) in WORKERS.items()]
    rates: dict[tuple[str, str], list[float]] = {(w.label, m): [] for w in workers for m in models}
    steps: dict[tuple[str, str], int] = {}
    try:
        # Warm up and size each burst to about burst_s seconds.
        # The warm-up runs the same 70 steps on every worker: its losses show that
        # both frameworks train the same model on the same batches.
        warm_loss: dict[str, float] = {}
        for w in workers:
            for m in models:
                w.ask(cmd="run", model=m, steps=20)
                r = w.ask(cmd="run", model=m, steps=50)
                warm_loss[f"{w.label}|{m}"] = r["loss"]
                steps[(w.label, m)] = max(20, int(50 / r["elapsed"] * burst_s))
        for rep in progress(range(repeats), desc="repeats", total=repeats):
            order = workers if rep % 2 == 0 else workers[::-1]  # alternate who goes first
            for m in models:
                for w in order:
                    n = steps[(w.label, m)]
                    r = w.ask(cmd="run", model=m, steps=n)
                    rates[(w.label, m)].append(n / r["elapsed"])
                    time.sleep(pause_s)  # let BLAS/OpenMP spinning threads go idle
        finals = {w.label: w.finish() for w in workers}
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
    return {
        "rates": {f"{k[0]}|{k[1]}": v for k, v in rates.items()},
        "warm_loss": warm_loss,
        "workers": {w.label: {**w.hello, **finals[w.label]} for w in workers},
        "models": models,
        "repeats": repeats,
        "burst_s": burst_s,
    }


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def render(raw: dict[str, Any]) -> str:
    """Markdown tables: steps/s per model and setting with ratios, then RSS per process."""
    from benchmarks.common import markdown_table

    models = raw["models"]
    rates = raw["rates"]
    workers = raw["workers"]
    tl, tl1, th, th1 = WORKERS

    def med(label: str, m: str) -> float:
        return _median(rates[f"{label}|{m}"])

    def spread(label: str, m: str) -> str:
        xs = rates[f"{label}|{m}"]
        return f"{med(label, m):,.0f} ({min(xs):,.0f}–{max(xs):,.0f})"

    rows = []
    for m in models:
        cfg = MODELS[m]
        best_tl = max(med(tl, m), med(tl1, m))
        best_th = max(med(th, m), med(th1, m))
        rows.append(
            [
                f"{m} (batch {cfg['batch']}, {cfg['loss']})",
                f"{workers[tl]['n_params'][m]:,} / {workers[th]['n_params'][m]:,}",
                spread(tl, m),
                spread(tl1, m),
                spread(th, m),
                spread(th1, m),
                f"{med(tl, m) / med(th, m):.2f}×",
                f"{med(tl1, m) / med(th1, m):.2f}×",
                f"**{best_tl / best_th:.2f}×**",
                f"{raw['warm_loss'][f'{tl}|{m}']:.6g} / {raw['warm_loss'][f'{th}|{m}']:.6g}",
            ]
        )
    speed = markdown_table(
        [
            "model",
            "params (ours / torch)",
            f"trainer_lite ({workers[tl]['threads']} BLAS threads)",
            "trainer_lite (1 BLAS thread)",
            f"torch ({workers[th]['threads']} threads)",
            "torch (1 thread)",
            "ratio, default threads",
            "ratio, 1 thread",
            "ratio, best vs best",
            "loss, steps 21–70 (ours / torch)",
        ],
        rows,
    )
    rss_rows = []
    torch_peak = max(workers[th]["peak_rss_mib"], workers[th1]["peak_rss_mib"])
    for label in WORKERS:
        w = workers[label]
        rss_rows.append(
            [
                label,
                "yes" if w["torch_loaded"] else "no",
                f"{w['import_rss_mib']:.1f}",
                f"{w['peak_rss_mib']:.1f}",
                f"{w['peak_rss_mib'] / torch_peak:.2f}",
            ]
        )
    rss = markdown_table(
        [
            "worker process",
            "torch imported",
            "RSS after imports (MiB)",
            "peak RSS (MiB)",
            "peak / torch peak",
        ],
        rss_rows,
    )
    return (
        "Steps per second: median over repeats (min–max in brackets); ratio = trainer_lite / torch.\n\n"
        + speed
        + "\n\nBoth start from the same float32 weights and see the same batches in the same order, "
        "so their losses over the shared warm-up steps agree up to float32 rounding.\n\n"
        "Peak resident memory of each worker process after training every model above (the torch "
        "workers also import trainer_lite, about 1 MiB, to build the shared weights; their "
        "after-import figure is torch alone):\n\n" + rss
    )


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import machine_line, study_parser, write_result

    parser = study_parser(
        "trainer_lite vs torch (CPU): steps/s and peak RSS, each framework in its own process",
        default_seeds=(0,),
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=DEFAULT_MODELS)
    parser.add_argument("--repeats", type=int, default=9, help="timed bursts per worker and model")
    parser.add_argument("--burst", type=float, default=0.5, help="seconds per timed burst")
    parser.add_argument("--pause", type=float, default=0.2, help="idle seconds after each burst")
    parser.add_argument("--worker", choices=["trainer_lite", "torch", "torch1"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=str, default=None, help="also write the raw rates to this JSON file")
    parser.add_argument(
        "--include",
        nargs="*",
        default=[],
        help="raw JSON files written by --json on other machines, rendered below this run's tables",
    )
    args = parser.parse_args(argv)
    seed = args.seeds[0]
    if args.worker:
        worker_main(args.worker, args.models, seed)
        return 0
    repeats, burst = (3, 0.2) if args.quick else (args.repeats, args.burst)
    load_before = os.getloadavg()
    raw = measure(args.models, repeats, burst, args.pause, seed)
    raw["machine"] = machine_line()
    raw["load"] = [load_before, os.getloadavg()]
    raw["cpus"] = os.cpu_count()
    raw["cpu_model"] = _cpu_model()
    raw["command"] = "python -m benchmarks.trainer_speed " + " ".join(sys.argv[1:] if argv is None else argv)
    body = render(raw) + _targets(raw) + _notes(raw)
    for path in args.include:
        with open(path) as fh:
            other = json.load(fh)
        cpu = other.get("cpu_model", "unknown CPU")
        body += f"\n\n## Also measured on: {other['machine']} ({cpu})\n\n"
        body += f"Command there: `{other['command']}`\n\n" + render(other) + _targets(other) + _notes(other)
    # Files first, so a closed stdout (``| head``) cannot lose a finished measurement.
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(raw, fh, indent=1)
    if not args.no_write:
        path = write_result("trainer_speed", body)
        print(f"wrote {path}", file=sys.stderr)
    print(body)
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _targets(raw: dict[str, Any]) -> str:
    """The issue's targets, checked on this run's medians (only for the models that have one)."""
    rates, workers = raw["rates"], raw["workers"]
    tl, tl1, th, th1 = WORKERS
    lines = []
    for m in [m for m in DEFAULT_MODELS if m in raw["models"]]:
        med = {label: _median(rates[f"{label}|{m}"]) for label in WORKERS}
        one = med[tl1] / med[th1]
        best = max(med[tl], med[tl1]) / max(med[th], med[th1])
        default = med[tl] / med[th]
        if min(one, best, default) >= 2.0:
            verdict = "met in every setting"
        elif min(one, best) >= 2.0:
            verdict = "met with one thread and best vs best, not with default threads (see the note below)"
        else:
            verdict = "NOT met"
        lines.append(
            f"- {m}: trainer_lite / torch = {one:.2f}× with one thread each, {best:.2f}× best setting vs "
            f"best setting, {default:.2f}× with default threads; target ≥ 2×: {verdict}."
        )
    tl_peak = max(workers[tl]["peak_rss_mib"], workers[tl1]["peak_rss_mib"])
    th_peak = min(workers[th]["peak_rss_mib"], workers[th1]["peak_rss_mib"])
    verdict = "met" if tl_peak < th_peak / 3 else "NOT met"
    lines.append(
        f"- Peak RSS: trainer_lite {tl_peak:.1f} MiB vs torch {th_peak:.1f} MiB = {tl_peak / th_peak:.2f}; "
        f"target < 1/3: {verdict}."
    )
    return "\n\nTargets (issue 3):\n\n" + "\n".join(lines)


def _notes(raw: dict[str, Any]) -> str:
    described = "; ".join(f"{m}: {MODELS[m]['desc']}" for m in raw["models"])
    (b1, b5, b15), (a1, a5, a15) = raw["load"]
    versions = ", ".join(sorted({w["version"] for w in raw["workers"].values()}))
    return (
        f"\n\nModels: {described}. float32, Adam, {raw['repeats']} bursts of ~{raw['burst_s']}s "
        f"per worker and model, round-robin ({versions}).  \n"
        f"Load average (1/5/15 min) before: {b1:.2f}/{b5:.2f}/{b15:.2f}, after: {a1:.2f}/{a5:.2f}/{a15:.2f} "
        f"on {raw['cpus']} CPUs.  \n"
        "Default threads: NumPy's OpenBLAS and torch's OpenMP pools spin-wait for each other's "
        "threads; when other processes hold the cores, a GEMM split over threads waits on a "
        "descheduled one, so the default-thread columns swing by 10–100× on a shared machine. "
        "For these batch sizes one thread is as fast as many on an idle machine; start a device's "
        "trainer with OPENBLAS_NUM_THREADS=1.\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())

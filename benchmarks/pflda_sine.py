"""PFL-DA §4.1: shifted sines over 500 clients — PFL-DA vs Ditto vs indiv.

``python -m benchmarks.pflda_sine [--quick] [--seeds 0 1 2 3 4 5] [--rounds N]``

Every client ``i`` sees ``y = a_i·sin(2π(x − b_i))`` with ``a_i ~ U[0.8, 1.2]`` and
``b_i ~ U[−½, ½]``; 490 clients hold 100 points, 10 hold 5 (the paper).  As in the
authors' ``sineregression.py``, a rich client's points are 100 evenly spaced x on
[−0.2, 1.2] and a sparse client's 5 evenly spaced x on [0, 1]; the score is the
test MSE of the sparse clients' personal models on 100 grid points of [0, 1].

The model is theirs in shape, narrower for time (see ``SineConfig``): encoder
``Φ_β(x) = Π(x + NN_β(1))`` with ``Π(φ) = φ mod 1 − ½`` (their ``phi % 1 - 0.5``),
``NN`` a shortcut ``Linear(1, 1)`` plus an MLP ``1 → h → h → 1``; decoder
``Linear(1, w)``, ReLU, three residual ``relu(Linear(w, w)) + ·`` blocks, ``Linear(w, 1)``.
Their schedule: Adam, lr 5e-3 × 0.9 every 5 rounds, weight decay 3e-7, uniform
server mean, λ1 = 0.9 convex pull only after the first inner step of a round;
Ditto's global copy is trained with SGD and its encoder copy pulled back too.

The 500 clients run the very client-algorithm code of ``trainer_lite`` and the one
``RoundEngine``, vectorized: clients with the same data shape are stacked along a
leading axis (:class:`StackedFleet`), so one NumPy call serves 490 clients.  The
algorithm is unchanged — every array operation is per client, and a stacked run
matches separate per-client runs to rounding (``tests/studies/test_pflda_quick.py``).
"""

from __future__ import annotations

import os

# One BLAS thread per process: batched small GEMMs get slower, not faster, with more.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from benchmarks.study_models import register_study_models
from benchmarks.study_models import stacked_mse as stacked_mse  # the loss its fleets train with
from cloud_aggregator.aggregation.strategies import Strategy, make_strategy
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.engine import MemoryStore, RoundEngine
from cloud_aggregator.rounds.types import CollectRequest, RoundRecord
from trainer_lite.algorithms import ClientAlgorithm, make_client
from trainer_lite.client import derive_rng
from trainer_lite.data import Dataset
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

# The study's model and loss are named in its task specs (benchmarks.study_models).
register_study_models()


def keep_freed_memory() -> None:
    """Ask glibc to keep freed blocks in the heap instead of returning them to the OS.

    Every inner step allocates dozens of multi-megabyte temporaries (490 clients ×
    100 points × width); with glibc's defaults each is a fresh ``mmap`` that
    page-faults again, which costs about a third of a step on this machine.  A no-op
    where there is no glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)
        libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):
        return


# ---------------------------------------------------------------------------
# Vectorized fleet: parameters and data with a leading client (or replica) axis.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StackedDataset(Dataset):
    """A dataset whose ``x`` is ``(..., n, d)``: one ``(n, d)`` set per leading index.

    ``len`` is ``n``, the sample count of each member.  Full-batch only.
    """

    def __post_init__(self) -> None:
        if self.x.ndim < 2 or self.y.shape[:-1] != self.x.shape[:-1]:
            raise ValueError(
                f"need x (..., n, d) and y (..., n, k) with equal leading shape, got {self.x.shape}, {self.y.shape}"
            )
        if not (np.isfinite(self.x).all() and np.isfinite(self.y).all()):
            raise ValueError("dataset holds NaN or Inf")

    def __len__(self) -> int:
        return int(self.x.shape[-2])


@dataclass(frozen=True)
class Block:
    """Members sharing one data shape, stacked along the leading axis.

    In client mode the members are clients (``members`` their ids); in replica
    mode a block is one device and the members are the replicas.
    """

    members: tuple[str, ...]
    train: StackedDataset
    test: StackedDataset | None = None


class StartStore(MemoryStore):
    """A memory store whose first resume point is given global parameters."""

    def __init__(self, start: Params) -> None:
        super().__init__()
        self._start = start

    def resume_point(self, task: str) -> tuple[int, int, Params, dict[str, Any]] | None:
        return super().resume_point(task) or (1, 0, self._start, {})


class StackedFleet:
    """An in-process fleet whose devices are stacks of members, run by the ordinary client algorithm.

    Parameters
    ----------
    spec
        The task; its hyperparameters must use full batches and ``loss="stacked_mse"``.
    blocks
        ``{block id: Block}``.
    replicas
        ``None`` (client mode): each block stacks clients of one federation; the
        global model is broadcast to every member and each member's upload is its
        own ``Update``, so the server averages over all clients as usual.
        A list of seeds (replica mode): ``len(replicas)`` independent federations
        with one device per block; every parameter, the global included, carries
        a leading replica axis and member ``r`` starts exactly as a per-client run
        with ``TaskSpec.seed = replicas[r]`` would.
    """

    def __init__(
        self, spec: TaskSpec, blocks: Mapping[str, Block], *, replicas: Sequence[int] | None = None
    ) -> None:
        self.spec = spec
        self.algo: ClientAlgorithm = make_client(spec)
        cfg = self.algo.config
        if getattr(cfg, "batch_size", None) is not None or getattr(cfg, "loss", None) != "stacked_mse":
            raise ValueError("a stacked fleet needs full batches (batch_size=None) and loss='stacked_mse'")
        self.blocks = dict(blocks)
        self.replicas = None if replicas is None else list(replicas)
        dtype = spec.dtype
        self.local: dict[str, Params] = {}
        for bid, block in self.blocks.items():
            if self.replicas is None:
                inits = [self.algo.init_local(derive_rng(spec.seed, m, "init")) for m in block.members]
            else:
                if len(block.members) != 1 or block.train.x.shape[0] != len(self.replicas):
                    raise ValueError(f"replica block {bid!r} needs one member and data stacked per replica")
                inits = [self.algo.init_local(derive_rng(s, block.members[0], "init")) for s in self.replicas]
            self.local[bid] = {n: np.stack([i[n] for i in inits]).astype(dtype) for n in inits[0]}

    def initial_global(self, strategy: Strategy) -> Params:
        """The replicas' initial globals stacked (replica mode), else the strategy's own."""
        if self.replicas is None:
            return strategy.init_global()
        inits = [make_strategy(replace(self.spec, seed=s)).init_global() for s in self.replicas]
        return {n: np.stack([i[n] for i in inits]) for n in inits[0]}

    def _shared_for(self, bid: str, global_params: Params) -> Params:
        if self.replicas is not None:
            return global_params
        b = len(self.blocks[bid].members)
        return {n: np.broadcast_to(v, (b, *v.shape)) for n, v in global_params.items()}

    def collect(self, request: CollectRequest) -> list[Update]:
        if request.downlinks or getattr(request, "participants", None) is not None:
            raise ValueError(
                "a stacked fleet broadcasts one global model to every member; run strategies with "
                "per-device downlinks or server-side selection on cloud_aggregator.rounds.simulation.SimulatedFleet"
            )
        out: list[Update] = []
        for bid, block in self.blocks.items():
            shared = self._shared_for(bid, request.global_params)
            rng = derive_rng(self.spec.seed, bid, request.round, request.phase)
            result, new_local = self.algo.update(
                shared, self.local[bid], block.train, rng=rng, round_=request.round, phase=request.phase
            )
            self.local[bid] = {n: np.asarray(v, dtype=self.spec.dtype) for n, v in new_local.items()}
            up = {n: np.asarray(v, dtype=self.spec.dtype) for n, v in result.shared.items()}
            k = len(block.members) if self.replicas is None else len(self.replicas)
            metrics = {n: v / k for n, v in result.metrics.items()}
            if self.replicas is not None:
                out.append(Update(bid, up, result.n_samples, metrics))
            else:
                out.extend(
                    Update(m, {n: v[i] for n, v in up.items()}, result.n_samples, metrics)
                    for i, m in enumerate(block.members)
                )
        return out

    def predict(self, global_params: Params, bid: str, x: np.ndarray) -> np.ndarray:
        """Personal-model predictions of every member of ``bid`` at ``x`` (stacked like the data)."""
        return self.algo.predict(self._shared_for(bid, global_params), self.local[bid], x)

    def test_mse(self, global_params: Params, bid: str) -> np.ndarray:
        """Each member's personal-model test MSE, shape ``(members,)``."""
        test = self.blocks[bid].test
        if test is None:
            raise ValueError(f"block {bid!r} has no test data")
        diff = self.predict(global_params, bid, test.x) - test.y
        return np.mean(diff * diff, axis=(-2, -1))


def run_stacked(
    spec: TaskSpec,
    fleet: StackedFleet,
    on_round: Callable[[RoundRecord, Params], None] | None = None,
) -> Params:
    """Run ``spec`` over a stacked fleet with the one ``RoundEngine``; returns the final global."""
    strategy = make_strategy(spec)
    store = StartStore(fleet.initial_global(strategy)) if fleet.replicas is not None else MemoryStore()
    engine: RoundEngine

    def record(rec: RoundRecord) -> None:
        if on_round is not None:
            on_round(rec, engine.global_params)

    engine = RoundEngine(spec, fleet, strategy=strategy, store=store, on_record=record)
    return engine.run()


# ---------------------------------------------------------------------------
# The study.
# ---------------------------------------------------------------------------

METHODS = ("pflda", "ditto", "indiv")
LABELS = {"pflda": "PFL-DA", "ditto": "Ditto", "indiv": "indiv"}
#: The authors' code on this kind of machine (seed 0, 50 rounds, mean of rounds 46-50), run once for reference.
AUTHORS = {"pflda": 0.0091, "ditto": 0.278, "indiv": 0.235}


@dataclass(frozen=True)
class SineConfig:
    """One run of the study.

    The authors' code trains a 128-wide decoder and a 256-wide encoder MLP with
    about 50 inner steps a round; on this 2-core machine that is hours for 500
    clients, so the defaults are narrower (``width``, ``encoder_hidden``) and take
    fewer inner steps (``steps``) — everything else is their schedule.
    """

    clients: int = 500
    sparse: int = 10
    rich_points: int = 100
    sparse_points: int = 5
    test_points: int = 100
    rounds: int = 40
    steps: int = 20
    width: int = 16
    encoder_hidden: int = 8
    lr: float = 5e-3
    lr_decay: float = 0.9
    lr_decay_every: int = 5
    weight_decay: float = 3e-7
    lam: float = 0.9
    dtype: str = "float32"
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)


def quick_config() -> SineConfig:
    """``--quick``: 60 clients (10 sparse), 30 rounds of 20 steps — under a minute, same ordering."""
    return replace(SineConfig(), clients=60, sparse=10, rounds=30, steps=20)


def sine_blocks(cfg: SineConfig, seed: int) -> tuple[dict[str, Block], np.ndarray, np.ndarray]:
    """The clients' data, stacked by shape: block ``sparse`` (scored) and ``rich``.

    Returns the blocks and every client's amplitude and phase shift (sparse first).
    """
    rng = np.random.default_rng(seed)
    amp = rng.uniform(0.8, 1.2, cfg.clients)
    shift = rng.uniform(-0.5, 0.5, cfg.clients)
    dt = np.dtype(cfg.dtype)

    def stack(x: np.ndarray, idx: np.ndarray) -> StackedDataset:
        xs = np.broadcast_to(x[None, :, None], (len(idx), len(x), 1))
        ys = amp[idx, None, None] * np.sin(2 * np.pi * (xs - shift[idx, None, None]))
        return StackedDataset(np.ascontiguousarray(xs, dtype=dt), ys.astype(dt))

    ids = np.array([f"c{i:03d}" for i in range(cfg.clients)])
    sparse, rich = np.arange(cfg.sparse), np.arange(cfg.sparse, cfg.clients)
    grid = np.linspace(0.0, 1.0, cfg.test_points)
    blocks = {
        "sparse": Block(
            tuple(ids[sparse]), stack(np.linspace(0.0, 1.0, cfg.sparse_points), sparse), stack(grid, sparse)
        ),
        "rich": Block(tuple(ids[rich]), stack(np.linspace(-0.2, 1.2, cfg.rich_points), rich)),
    }
    return blocks, amp, shift


def sine_spec(cfg: SineConfig, method: str, seed: int) -> TaskSpec:
    """The task each method runs: the authors' schedule (see the module docstring)."""
    hp: dict[str, Any] = {
        "lr": cfg.lr,
        "lr_decay": cfg.lr_decay,
        "lr_decay_every": cfg.lr_decay_every,
        "weight_decay": cfg.weight_decay,
        "local_steps": cfg.steps,
        "loss": "stacked_mse",
    }
    if method == "pflda":
        hp.update(lam=cfg.lam, pull="convex", pull_at="first")
    elif method == "ditto":
        hp.update(
            lam=cfg.lam,
            pull="convex",
            pull_at="first",
            personal_pull=["decoder"],
            global_pull=["encoder"],
            global_optimizer="sgd",
        )
    elif method != "indiv":
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    hp.update(cfg.extra.get(method, {}))
    return TaskSpec(
        name=f"sine-{method}",
        algorithm=method,
        model="pflda_sine",
        model_args={"width": cfg.width, "encoder_hidden": cfg.encoder_hidden},
        hparams=hp,
        server={"weighting": "uniform"},
        dtype=cfg.dtype,
        rounds=cfg.rounds,
        seed=seed,
    )


def decoder_spread(fleet: StackedFleet, global_params: Params, points: int = 200) -> dict[str, float]:
    """How close the learned personal decoders are to one sine.

    Every client's decoder ``g_i`` is evaluated on a grid of features ``φ`` in
    [−½, ½).  ``spread`` is the mean over clients of ``‖g_i − ḡ‖² / ‖ḡ‖²`` (ḡ the
    mean curve); ``sine_resid`` is the relative residual of the best fit
    ``A·sin(2πφ) + B·cos(2πφ) + C`` to ḡ; ``amplitude`` is that fit's amplitude.
    """
    phi = np.linspace(-0.5, 0.5, points, endpoint=False)
    algo = fleet.algo
    dec = dict(algo.model.layers)["decoder"]
    curves = []
    for bid, block in fleet.blocks.items():
        params = algo.personal_params(fleet._shared_for(bid, global_params), fleet.local[bid])
        head = "decoder."
        sub = {k[len(head) :]: v for k, v in params.items() if k.startswith(head)}
        x = np.broadcast_to(phi[None, :, None], (len(block.members), points, 1)).astype(fleet.spec.dtype)
        curves.append(dec(sub, x)[..., 0])
    g = np.concatenate(curves).astype(np.float64)
    mean = g.mean(axis=0)
    spread = float(np.mean(np.sum((g - mean) ** 2, axis=1)) / np.sum(mean**2))
    basis = np.stack([np.sin(2 * np.pi * phi), np.cos(2 * np.pi * phi), np.ones_like(phi)], axis=1)
    coef, *_ = np.linalg.lstsq(basis, mean, rcond=None)
    resid = float(np.sum((basis @ coef - mean) ** 2) / np.sum((mean - mean.mean()) ** 2))
    return {"spread": spread, "sine_resid": resid, "amplitude": float(np.hypot(coef[0], coef[1]))}


def run_one(cfg: SineConfig, method: str, seed: int) -> dict[str, Any]:
    """One method and seed: the learning curve (sparse clients' test MSE per round) and diagnostics."""
    blocks, _, _ = sine_blocks(cfg, seed)
    spec = sine_spec(cfg, method, seed)
    fleet = StackedFleet(spec, blocks)
    curve: list[float] = []
    start = time.perf_counter()

    def on_round(rec: RoundRecord, global_params: Params) -> None:
        curve.append(float(np.mean(fleet.test_mse(global_params, "sparse"))))

    final = run_stacked(spec, fleet, on_round)
    return {
        "method": method,
        "seed": seed,
        "curve": curve,
        "seconds": time.perf_counter() - start,
        **decoder_spread(fleet, final),
    }


def _worker(args: tuple[SineConfig, str, int]) -> dict[str, Any]:
    return run_one(*args)


def run_study(
    cfg: SineConfig, methods: Sequence[str], seeds: Sequence[int], *, workers: int = 2
) -> list[dict[str, Any]]:
    """Every method × seed, ``workers`` processes at a time (each single-threaded)."""
    from benchmarks.common import progress

    jobs = [(cfg, m, s) for s in seeds for m in methods]
    if workers <= 1:
        return [run_one(*j) for j in progress(jobs, "sine runs")]
    import multiprocessing as mp

    with mp.get_context("fork").Pool(workers) as pool:
        return list(progress(pool.imap(_worker, jobs), "sine runs", total=len(jobs)))


def summarize(cfg: SineConfig, runs: Sequence[dict[str, Any]], seconds: float) -> tuple[str, dict[str, Any]]:
    """The results table (markdown) and the numbers behind it."""
    from benchmarks.common import fmt_mean_std, markdown_table, mean_std

    methods = [m for m in METHODS if any(r["method"] == m for r in runs)]
    by = {m: [r for r in runs if r["method"] == m] for m in methods}
    final = {m: [r["curve"][-1] for r in by[m]] for m in methods}
    last5 = {m: [float(np.mean(r["curve"][-5:])) for r in by[m]] for m in methods}
    rows = []
    for m in methods:
        rows.append(
            [
                LABELS[m],
                fmt_mean_std(final[m], 4),
                fmt_mean_std(last5[m], 4),
                f"{AUTHORS[m]:.4f}",
                fmt_mean_std([r["spread"] for r in by[m]], 3),
                fmt_mean_std([r["sine_resid"] for r in by[m]], 4),
                fmt_mean_std([r["amplitude"] for r in by[m]], 3),
            ]
        )
    table = markdown_table(
        [
            "method",
            f"test MSE, round {cfg.rounds}",
            f"mean of rounds {cfg.rounds - 4}-{cfg.rounds}",
            "authors' code (seed 0, rounds 46-50)",
            "decoder spread",
            "mean decoder's sine-fit residual",
            "its amplitude",
        ],
        rows,
    )
    numbers: dict[str, Any] = {"final": {m: mean_std(final[m])[0] for m in methods}}
    numbers["last5"] = {m: mean_std(last5[m])[0] for m in methods}
    numbers["spread"] = {m: mean_std([r["spread"] for r in by[m]])[0] for m in methods}
    numbers["sine_resid"] = {m: mean_std([r["sine_resid"] for r in by[m]])[0] for m in methods}
    lines = [table, ""]
    if "pflda" in methods:
        p = numbers["last5"]["pflda"]
        for m in methods:
            if m != "pflda":
                lines.append(
                    f"- {LABELS[m]} / PFL-DA (mean of the last 5 rounds): {numbers['last5'][m] / p:.0f}×"
                )
        ratios = [numbers["last5"][m] / p for m in methods if m != "pflda"]
        met = p <= 0.01 and all(r >= 10 for r in ratios)
        lines.append(
            f"- Target (issue 3: PFL-DA ≤ 0.01 and ≥ 10× below Ditto and indiv): {'met' if met else 'NOT met'}"
            + (
                ""
                if met
                else " -- our narrow indiv (width 16, encoder 8) generalises far better than the authors' "
                "128/256-wide one, which overfits the 5-point clients; `--width 128 --encoder-hidden 256` "
                "restores their widths at hours of CPU for 500 clients"
            )
        )
    n_seeds = len({r["seed"] for r in runs})
    lines.append(
        f"- {n_seeds} seeds × {len(methods)} methods in {seconds:.0f} s wall-clock "
        f"(1-minute load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)."
    )
    return "\n".join(lines), numbers


NOTES = """\
Protocol (ours): {clients} clients, {sparse} of them with {sparse_points} points on [0, 1] and the rest with
{rich_points} points on [−0.2, 1.2] (the authors' grids); amplitudes U[0.8, 1.2], phase shifts U[−½, ½];
score = MSE of the sparse clients' personal models on {test_points} grid points of [0, 1], averaged over
them; {rounds} rounds of {steps} full-batch inner steps; Adam lr {lr} × {lr_decay} every {lr_decay_every}
rounds, weight decay {weight_decay}; uniform server mean; PFL-DA and Ditto use the authors' convex pull
(λ1 = {lam}) once per round, after the first inner step; Ditto's global copy trains with SGD and its
encoder copy is pulled back too (their code).  Model: decoder width {width} (theirs 128), encoder MLP
width {encoder_hidden} (theirs 256).

Where we differ from the authors' script, and why:
- Width, rounds and inner steps: their 128/256-wide networks with 50 rounds of ~50-150 inner steps
  take hours for 500 clients on this 2-core CPU; width {width} and {rounds} rounds of {steps} steps fit
  the 10-minute budget for six seeds (`--width`, `--rounds` and `--steps` raise them), so our
  "last 5 rounds" are rounds {rounds}-4 to {rounds} where theirs are 46-50.
- Their PFL-DA loop stops a client's inner steps early when its loss is below twice the last round's
  and re-initialises clients that stall; we run Algorithms 1-3 with a fixed step count instead.
- Their script trains 250 clients (11 sparse) through a dataset-length quirk and draws shifts from
  U[−2, 2]; we follow the paper (500 clients, 10 sparse, U[−½, ½]; the same phases modulo 1).

How close the learned decoders are to one sine: "decoder spread" is the mean over all clients of
‖g_i − ḡ‖²/‖ḡ‖² for the personal decoders g_i on a grid of features φ ∈ [−½, ½) (ḡ their mean
curve; near 0 = every client learned the same curve), and the residual is that of the best fit
A·sin 2πφ + B·cos 2πφ + C to ḡ relative to ḡ's variance (near 0 = that curve is a sine; its
amplitude should be near the mean amplitude 1).  The paper shows this study as Figures 1-2 only
(no table), so the authors'-code figures from issue 3 are the only numbers to compare with.
"""


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.common import RESULTS, plot_curves, study_parser, write_result

    parser = study_parser(__doc__.split("\n\n")[0], default_seeds=range(6))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--rounds", type=int, help="communication rounds (default 40)")
    parser.add_argument("--steps", type=int, help="inner steps per round (default 20)")
    parser.add_argument("--width", type=int, help="decoder width (default 16; the authors' 128)")
    parser.add_argument("--encoder-hidden", type=int, help="encoder MLP width (default 8; the authors' 256)")
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    args = parser.parse_args(argv)
    keep_freed_memory()
    cfg = SineConfig()
    if args.quick:
        cfg = quick_config()
    cfg = replace(
        cfg,
        **{
            k: v
            for k, v in (
                ("rounds", args.rounds),
                ("steps", args.steps),
                ("width", args.width),
                ("encoder_hidden", args.encoder_hidden),
            )
            if v
        },
    )
    seeds = args.seeds[:1] if args.quick and len(args.seeds) == 6 else args.seeds
    start = time.perf_counter()
    runs = run_study(cfg, args.methods, seeds, workers=args.workers)
    seconds = time.perf_counter() - start
    body, _ = summarize(cfg, runs, seconds)
    print(body)
    if not args.no_write and not args.quick:
        curves = {
            LABELS[m]: np.mean([r["curve"] for r in runs if r["method"] == m], axis=0) for m in args.methods
        }
        bands = {
            LABELS[m]: np.std([r["curve"] for r in runs if r["method"] == m], axis=0) for m in args.methods
        }
        png = plot_curves(
            RESULTS / "pflda_sine.png",
            curves,
            bands=bands,
            title=f"PFL-DA §4.1 sines: sparse clients' test MSE ({len(seeds)} seeds, mean ± std)",
            logy=True,
        )
        notes = NOTES.format(**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if k != "extra"})
        extra = f"\n\n![learning curves]({png.name})" if png else ""
        write_result("pflda_sine", body + "\n\n" + notes + extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compressed downlinks (``[task.compress] downlink``): bytes per round in both directions, and accuracy.

``python -m benchmarks.compress_downlink [--quick] [--seeds 0 1 2] [--rounds 20] [--printer-rounds 100]``
``[--loopback-repeats 3] [--loopback-rounds 10]``

The global goes down as EDEN codes of itself (``ioft_protocol.downlink``), the uploads as codes
of their change (``ioft_protocol.compress``); the aggregator runs each phase on the decoded
global, so devices and simulator train from the same bits.  Widths: float32 both ways, 1 bit up
only (the uplink study's), and 1 bit up with the global in 8 or 4 bits.  Measured here, with
``benchmarks.compress_uplink``'s harnesses:

* **payload bytes** of the announcement (P = 151k, the weld MLP plus a 13k layer) and of an
  upload, and the bytes per round at N = 20 they make (N announcements delivered, N uploads);
* **the broker's byte counter** over loopback mosquitto at N = 20, P = 151k (the ``echo`` task:
  devices upload the global they decoded);
* **accuracy** at each width in the in-process simulator: FedAvg on the weld MLP (accuracy within
  1 point of float32) and the demo's PFL-DA printer task (50·MSE within 2 %), the uplink study's
  bounds.

``--quick`` (a test's run) computes the payload bytes only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from benchmarks import compress_uplink as up
from benchmarks.common import study_parser, write_result
from benchmarks.pflda_printers import DEFAULT_DATA, load_runs
from ioft_protocol import compress
from ioft_protocol.downlink import quantize_global
from ioft_protocol.round_messages import Announcement
from trainer_lite.params import param_hash

#: float32 both ways, the uplink alone in 1 bit, and 1 bit up with 8 or 4 bits down.
WIDTHS: list[Any] = [None, 1, (1, 8), (1, 4)]
N = 20


def label(width: Any) -> str:
    if width is None:
        return "float32 both ways"
    if isinstance(width, tuple):
        return f"{width[0]} bit up, {width[1]} bits down"
    return f"{width} bit up, float32 down"


def payload_bytes(g: dict[str, np.ndarray], change: dict[str, np.ndarray]) -> dict[Any, dict[str, int]]:
    """``{width: {down, up, round}}``: one announcement, one upload, and N of each."""
    rows = {}
    for width in WIDTHS:
        how = up.compress_table(width)
        q = quantize_global(how, "bench", 3, "train", g)
        params, meta = (g, None) if q is None else q[1]
        shown = g if q is None else q[0]
        ann = Announcement(
            "plant-a", "bench", 3, "train", "{}", 0.0, param_hash(shown), params=params, downlink=meta
        )
        upload = {n: shown[n] + change[n] for n in g}
        up_how = None if how is None else {"bits": how["bits"]}
        codes = compress.encode_upload(
            upload, shown, up_how, task="bench", round_=3, phase="train", device="d", global_hash="h"
        )
        down_b, up_b = len(ann.encode()), len(up._payload(codes, up_how))
        rows[width] = {"down": down_b, "up": up_b, "round": N * (down_b + up_b)}
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0, 1, 2))
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the weld runs")
    parser.add_argument("--welds", type=int, default=120, help="welds per domain of the M group")
    parser.add_argument("--printer-rounds", type=int, default=100, help="rounds of the printer task")
    parser.add_argument(
        "--printers", default=str(DEFAULT_DATA), help="folder of FL_Dataset_Printer*_Speed*.csv"
    )
    parser.add_argument(
        "--loopback-repeats", type=int, default=3, help="interleaved repeats of the MQTT round"
    )
    parser.add_argument("--loopback-rounds", type=int, default=10, help="rounds measured per MQTT run")
    args = parser.parse_args(argv)
    if (
        min(args.rounds, args.printer_rounds, args.loopback_repeats, args.loopback_rounds) < 1
        or args.welds < 8
    ):
        raise SystemExit("--rounds, --printer-rounds and the loopback counts must be >= 1, --welds >= 8")
    sent, upload = up.synthetic_upload(up.P150K_SHAPES, 0)
    p = sum(v.size for v in sent.values())
    table = payload_bytes(sent, {n: upload[n] - sent[n] for n in sent})
    out: dict[str, Any] = {"bytes": table, "p": p}
    if args.quick:
        return out

    try:
        runs = load_runs(args.printers)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    load0 = os.getloadavg()
    printers = up.printer_loss(WIDTHS, args.seeds, args.printer_rounds, runs)
    print("printers", printers, flush=True)
    welds, weld_loss = up.weld_accuracy(WIDTHS, args.seeds, args.rounds, args.welds)
    print("welds", welds, weld_loss, flush=True)
    loop: dict[Any, list[dict[str, float]]] = {w: [] for w in WIDTHS}
    for _ in range(args.loopback_repeats):
        for w in WIDTHS:
            loop[w].append(up.loopback_round(N, p, w, args.loopback_rounds, warmup=2))
            print("loopback", w, loop[w][-1], flush=True)
    load1 = os.getloadavg()
    out |= {
        "printers": printers,
        "welds": welds,
        "weld_loss": weld_loss,
        "loopback": loop,
        "load": (load0, load1),
    }

    def med(w: Any) -> float:
        return float(np.median([r["broker_bytes_round"] for r in loop[w]]))

    def span(w: Any) -> str:
        v = [r["broker_bytes_round"] for r in loop[w]]
        return f"{med(w):,.0f} ({min(v):,.0f}–{max(v):,.0f})"

    def points(w: Any) -> float:
        return 100 * (float(np.mean(welds[w])) - float(np.mean(welds[None])))

    def rel(t: dict, w: Any) -> float:
        return 100 * (float(np.mean(t[w])) / float(np.mean(t[None])) - 1)

    best = (1, 4)
    ratio = med(None) / med(best)
    lines = [
        f"P = {p:,} parameters, N = {N} devices; load average {load0[0]:.1f} before, {load1[0]:.1f} after "
        "(2 cores, shared).",
        "",
        "| width | announcement bytes | upload bytes | N × both | float32 / this |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {label(w)} | {r['down']:,} | {r['up']:,} | {r['round']:,} | "
            f"{table[None]['round'] / r['round']:.1f}× |"
            for w, r in table.items()
        ),
        "",
        f"The broker's bytes per round (in + out), loopback mosquitto, `echo` task, {args.loopback_rounds} "
        f"rounds after 2 of warm-up, median (min–max) of {args.loopback_repeats} interleaved runs:",
        "",
        "| width | broker bytes per round | float32 / this | round time, s |",
        "|---|---:|---:|---:|",
        *(
            f"| {label(w)} | {span(w)} | {med(None) / med(w):.1f}× | "
            f"{np.median([r['round_s'] for r in loop[w]]):.3f} |"
            for w in WIDTHS
        ),
        "",
        f"Weld MLP, FedAvg, {args.rounds} rounds, 9 clients, seeds {args.seeds}: pooled test accuracy and "
        "cross-entropy, mean (min, max)",
        "",
        "| width | accuracy | vs float32 (points) | loss | vs float32 |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {label(w)} | {up._spread(welds[w])} | {points(w):+.2f} | {up._spread(weld_loss[w])} | "
            f"{rel(weld_loss, w):+.1f}% |"
            for w in WIDTHS
        ),
        "",
        f"Printers, the demo's PFL-DA task, {args.printer_rounds} rounds, seeds {args.seeds}: 50·MSE on Speed30",
        "",
        "| width | loss | vs float32 |",
        "|---|---:|---:|",
        *(f"| {label(w)} | {up._spread(printers[w])} | {rel(printers, w):+.2f}% |" for w in WIDTHS),
        "",
        "Targets (computed from the tables above):",
        "",
        f"- Bytes per round, both directions, ≥ 8× below float32 (1 bit up, 4 bits down): "
        f"{'met' if ratio >= 8 else 'missed'} (broker counter {ratio:.1f}×; payloads "
        f"{table[None]['round'] / table[best]['round']:.1f}×).",
        f"- Weld FedAvg within 1 point: {'met' if points(best) >= -1 else 'missed'} ({points(best):+.2f} points; "
        f"8 bits down {points((1, 8)):+.2f}).",
        f"- Printers PFL-DA within 2 % of the loss: {'met' if rel(printers, best) <= 2 else 'missed'} "
        f"({rel(printers, best):+.2f} %; 8 bits down {rel(printers, (1, 8)):+.2f} %).",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_result("compress_downlink", body)
    return out


if __name__ == "__main__":
    main()

"""What signed SecAgg keys cost a device per round: bytes per advertisement, sign + verify CPU.

Each device signs its advertisement once (ECDSA P-256 with its fleet certificate's key) and
sends its certificate (DER) along; each checks every neighbour's certificate against the fleet
CA and its signature (two ECDSA verifications per neighbour).  Measured in-process
(``ioft_protocol.secagg.simulate.run_round``, every message through its wire form), the same
round signed and unsigned; CPU is each device's thread CPU for its first two answers (advertise,
share keys), where all of the signing and checking happens.  MQTT framing is not counted.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from benchmarks.common import markdown_table, progress, study_parser, write_result
from cloud_aggregator.fleet.ca import FleetCA
from ioft_protocol.secagg import ClientSecAgg, SecAggConfig
from ioft_protocol.secagg.identity import FleetTrust, KeySigner, binding
from ioft_protocol.secagg.messages import AdvertiseKeys, pack
from ioft_protocol.secagg.simulate import run_round


def signers(ca: FleetCA, devices: list[str]) -> dict[str, KeySigner]:
    out = {}
    for d in devices:
        cert, key = ca.issue(d, days=1)
        out[d] = KeySigner(
            x509.load_pem_x509_certificate(cert), serialization.load_pem_private_key(key, None)
        )  # type: ignore[arg-type]
    return out


def case(n: int, length: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    devices = [f"dev-{i:04d}" for i in range(n)]
    updates = {d: rng.uniform(-1, 1, length) for d in devices}
    weights = dict.fromkeys(devices, 1.0)
    ca = FleetCA.create("bench", days=1)
    trust, keys = FleetTrust([ca.cert]), signers(ca, devices)
    cfg = SecAggConfig(threshold=0.6)
    runs = {}
    for signed in (False, True):

        def make(d: str, signed: bool = signed) -> ClientSecAgg:
            return ClientSecAgg(d, signer=keys[d], trust=trust) if signed else ClientSecAgg(d)

        runs[signed] = run_round(cfg, updates, weights, seed=seed, make_client=make, certificates=signed)
        if runs[signed].outcome.__class__.__name__ != "SecAggResult":
            raise RuntimeError(
                f"N = {n}, signed = {signed}: the round did not complete: {runs[signed].outcome}"
            )

    def med(signed: bool, what) -> float:
        return statistics.median(what(runs[signed], d) for d in devices)

    advert = lambda r, d: len(r.view["keys"][d])  # noqa: E731
    cpu = lambda r, d: r.stage_cpu_s["keys"][d] + r.stage_cpu_s["shares"][d]  # noqa: E731
    some = AdvertiseKeys.decode(runs[False].view["keys"][devices[0]])
    return {
        "n": n,
        "before": len(pack("keys", {"c_pk": some.c_pk, "s_pk": some.s_pk})),  # the two-field form
        "advert": (med(False, advert), med(True, advert)),
        # every other message is the same size signed or not: the difference is the relayed keys
        "down_added": statistics.median(
            runs[True].bytes_down[d] - runs[False].bytes_down[d] for d in devices
        ),
        "neighbours": med(True, lambda r, d: len(r.server.neighbours[d])),
        "cpu_ms": (med(False, cpu) * 1e3, med(True, cpu) * 1e3),
    }


def micro(repeats: int) -> dict[str, float]:
    """Median thread CPU of one signature and of one neighbour check (certificate + signature)."""
    ca = FleetCA.create("bench", days=1)
    s = signers(ca, ["dev-0001"])["dev-0001"]
    trust = FleetTrust([ca.cert])
    msg = binding("bench/speed/1/train", "s", "dev-0001", bytes(32), bytes(32))
    sig = s.sign(msg)
    sign, check = [], []
    for _ in range(repeats):
        t0 = time.thread_time()
        s.sign(msg)
        t1 = time.thread_time()
        trust.check("dev-0001", msg, s.cert_der, sig)
        t2 = time.thread_time()
        sign.append(t1 - t0)
        check.append(t2 - t1)
    return {"sign_ms": statistics.median(sign) * 1e3, "check_ms": statistics.median(check) * 1e3}


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.split("\n")[0], default_seeds=(0,))
    parser.add_argument("--devices", type=int, nargs="+", default=[20, 100, 1000])
    parser.add_argument("--params", type=int, default=1000, help="update length (does not change the keys)")
    parser.add_argument("--repeats", type=int, default=500, help="repeats of the sign/check micro-benchmark")
    args = parser.parse_args(argv)
    if args.quick:
        args.devices, args.repeats = [20, 100], 100
    m = micro(args.repeats)
    rows, results = [], []
    for n in progress(args.devices, "fleets"):
        r = case(n, args.params, args.seeds[0])
        results.append(r)
        rows.append(
            [
                r["n"],
                r["neighbours"],
                f"{r['before']} / {r['advert'][0]:.0f} / {r['advert'][1]:.0f} B",
                f"+{r['down_added'] / 1e3:.1f} KB",
                f"{r['cpu_ms'][0]:.2f} → {r['cpu_ms'][1]:.2f} ms",
                f"{m['sign_ms'] + r['neighbours'] * m['check_ms']:.2f} ms",
            ]
        )
    table = markdown_table(
        [
            "N",
            "neighbours",
            "advertisement (before / unsigned / signed)",
            "neighbours' keys received, added",
            "device CPU, advertise + share keys (unsigned → signed)",
            "1 sign + neighbours × check",
        ],
        rows,
    )
    body = (
        f"{__doc__.split(chr(10) + chr(10), 1)[1]}\n"
        f"One signature: {m['sign_ms']:.3f} ms; one neighbour check (certificate chain, name, signature): "
        f"{m['check_ms']:.3f} ms (median thread CPU of {args.repeats}).\n\n{table}\n"
    )
    print(body)
    if not args.no_write:
        write_result("secagg_signed_keys", body)
    return {"micro": m, "cases": results}


if __name__ == "__main__":
    main()

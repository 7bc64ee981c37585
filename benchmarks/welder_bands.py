"""Where the simulated welds carry the tool's wear, per domain: worn / new energy in each DWT band.

``python -m benchmarks.welder_bands [--seeds 0 1 ... 7]``

A property of the simulator (:mod:`sensors.sim.welder`), not of a learning method: for each
material pair and surface, the microphone channel's mean energy per DWT detail band
(db4, 200 kHz) of worn-tool welds over that of new-tool welds (both tools worn or both new,
0.5 s welds at ``time_scale`` 0.3), averaged over the seeds.  A ratio well above 1 marks the
band that carries the wear signature in that domain.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import pywt

from benchmarks.common import markdown_table, study_parser, write_result
from sensors.sim.welder import WeldCondition, simulate_weld

DOMAINS = (
    ("Al-Al", "clean"),
    ("Al-Cu", "clean"),
    ("Cu-Al", "clean"),
    ("Cu-Cu", "clean"),
    ("Cu-Cu", "polished"),
    ("Cu-Cu", "contaminated"),
)
BANDS = ("d1 50-100 kHz", "d2 25-50 kHz", "d3 12.5-25 kHz (carrier)", "d4 6.25-12.5 kHz", "d5 3.1-6.25 kHz")
MIC = 3  # the microphone channel of a WeldRecording


def band_energy(tool: str, material: str, surface: str, seed: int) -> np.ndarray:
    """Mean squared DWT detail coefficient of the microphone, bands d1..d5."""
    rec = simulate_weld(
        WeldCondition(tool, tool, surface, material, 0.5), np.random.default_rng(seed), time_scale=0.3
    )
    coeffs = pywt.wavedec(np.array(rec.data[MIC]), "db4", level=6)[::-1]
    return np.array([np.mean(c**2) for c in coeffs[: len(BANDS)]])


def table(seeds: Sequence[int]) -> str:
    rows = []
    for material, surface in DOMAINS:
        worn = np.mean([band_energy("worn", material, surface, s) for s in seeds], axis=0)
        new = np.mean([band_energy("new", material, surface, s) for s in seeds], axis=0)
        rows.append([material, surface, *(f"{r:.2f}" for r in worn / new)])
    return markdown_table(["material", "surface", *BANDS], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = study_parser(__doc__.split("\n\n")[0], default_seeds=tuple(range(8)))
    args = parser.parse_args(argv)
    body = (
        f"Worn / new microphone energy per DWT band, mean over seeds {list(args.seeds)} "
        "(0.5 s welds, time_scale 0.3, both tools worn vs both new).\n\n" + table(args.seeds)
    )
    print(body)
    if not args.no_write:
        write_result(
            "welder_bands", body, command="python -m benchmarks.welder_bands " + " ".join(sys.argv[1:])
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

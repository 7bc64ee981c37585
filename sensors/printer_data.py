"""Reader for the six-printer data set of PFL-DA's case study (Chou & Okwudire 2021).

The files are read from where they lie (``--data PATH``); the project never copies them.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np

from sensors.layers import check_layer_table

_NAME = re.compile(r"FL_Dataset_Printer(\d+)_Speed(\d+)\.csv$")


def load_printer_runs(root: str | Path, *, drop_first_row: bool = True) -> dict[int, dict[int, np.ndarray]]:
    """Load every ``FL_Dataset_Printer{p}_Speed{s}.csv`` below ``root``.

    Parameters
    ----------
    root
        Folder holding the 72 CSV files.
    drop_first_row
        The authors' loader infers a header and so drops the first row of every file
        (14 of 15 layers used).  ``True`` reproduces their protocol.

    Returns
    -------
    dict
        ``{printer: {speed_setting: table}}`` with tables of shape ``(n, 3)``
        (speed, sigma_ax, sigma_ay).
    """
    folder = Path(root)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"printer data folder {folder} not found; pass the folder holding "
            "FL_Dataset_Printer*_Speed*.csv (e.g. ../shared/data/printers)"
        )
    runs: dict[int, dict[int, np.ndarray]] = {}
    for path in sorted(folder.iterdir()):
        match = _NAME.search(path.name)
        if not match:
            continue
        runs.setdefault(int(match.group(1)), {})[int(match.group(2))] = _read_table(path, drop_first_row)
    if not runs:
        raise FileNotFoundError(f"no FL_Dataset_Printer*_Speed*.csv files in {folder}")
    return runs


def _read_table(path: Path, drop_first_row: bool) -> np.ndarray:
    """One file's layer table; a ``ValueError`` that names the file (an empty one included: NumPy
    only warns there, and a warning beside the error would be a second line to read)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            table = np.loadtxt(path, delimiter=",", ndmin=2)
        return check_layer_table(table[1:] if drop_first_row else table)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def split_by_speed(
    runs: dict[int, np.ndarray], test_speeds: tuple[int, ...] = (30,)
) -> tuple[np.ndarray, np.ndarray]:
    """Split one printer's runs into (train, test) tables by speed setting (Table 5: test = speed 30)."""
    train = [t for s, t in sorted(runs.items()) if s not in test_speeds]
    test = [t for s, t in sorted(runs.items()) if s in test_speeds]
    if not train or not test:
        raise ValueError(f"need runs both in and outside test speeds {test_speeds}, have {sorted(runs)}")
    return np.concatenate(train), np.concatenate(test)

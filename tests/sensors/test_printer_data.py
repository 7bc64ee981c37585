"""The six-printer data set's reader: a bad file is named in the one line that says what is wrong."""

from __future__ import annotations

import warnings

import pytest

from sensors.printer_data import load_printer_runs

#: As the data set's files are: no header, speed and the two vibration levels per layer.
GOOD = "".join(f"30,{0.1 * i:.3f},{0.2 * i:.3f}\n" for i in range(1, 6))


@pytest.mark.parametrize(
    "text", ["", "30,0.1\n30,0.1\n30,0.2\n", "30,0.1,0.2\n30,nan,0.2\n", "30,0.1,0.2\nspeed,0.1,0.2\n"],
    ids=["empty", "two columns", "NaN", "a word"],
)  # fmt: skip
def test_a_bad_file_is_named_in_one_error_and_no_warning(tmp_path, text):
    (tmp_path / "FL_Dataset_Printer1_Speed10.csv").write_text(GOOD)
    bad = tmp_path / "FL_Dataset_Printer2_Speed30.csv"
    bad.write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's "input contained no data" came as a second line
        with pytest.raises(ValueError, match=str(bad)):
            load_printer_runs(tmp_path)


def test_good_files_load_as_layer_tables(tmp_path):
    (tmp_path / "FL_Dataset_Printer1_Speed30.csv").write_text(GOOD)
    runs = load_printer_runs(tmp_path)
    assert runs[1][30].shape == (4, 3)  # the first row dropped, as the authors' loader does

"""Every simulated machine ``edge-trainer --simulate`` offers is named in the operator's docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edge.cli import parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_every_simulate_choice_is_documented(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    found = re.search(r"--simulate \{([^}]*)\}", capsys.readouterr().out)
    assert found is not None
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    missing = [c for c in found.group(1).split(",") if f"--simulate {c}" not in docs]
    assert missing == [], f"README.md (or docs/) never mentions --simulate {missing}"

"""trainer_lite runs on a Pi without torch: importing any of its modules must not import torch."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import importlib, json, pkgutil, sys
import trainer_lite
names = [m.name for m in pkgutil.walk_packages(trainer_lite.__path__, "trainer_lite.")]
for name in names:
    importlib.import_module(name)
torch_mods = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps({"modules": names, "torch": torch_mods}))
"""


def test_trainer_lite_never_imports_torch():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(out.stdout)
    # The walk really reached the trainer's modules (a broken walk would pass vacuously).
    assert {"trainer_lite.layers.gaussian", "trainer_lite.losses", "trainer_lite.optim"} <= set(
        report["modules"]
    )
    assert any(m.startswith("trainer_lite.algorithms.") for m in report["modules"])
    assert report["torch"] == [], f"trainer_lite imported {report['torch']}"

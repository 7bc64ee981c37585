"""The recorder's command line stands apart from the trainer's: importing it loads neither the
daemon, the model manager nor the swarm (a Pi that only records pays for none of them)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import edge.recording.cli
print(json.dumps(sorted(m for m in sys.modules if m == "edge" or m.startswith("edge."))))
"""


def test_importing_the_recorder_cli_loads_no_daemon_models_or_swarm():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(json.loads(out.stdout))
    assert "edge.recording.cli" in loaded
    assert not loaded & {"edge.daemon", "edge.models", "edge.swarm", "edge.cli"}, sorted(loaded)


def test_the_recorder_loads_nothing_of_serving():
    # The row, its feed and the status file's name live below both (edge.rows, edge.feed).
    probe = PROBE.replace("import edge.recording.cli", "import edge.recording.printer, edge.recording.welder")
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(json.loads(out.stdout))
    assert {"edge.rows", "edge.feed"} <= loaded
    assert not {m for m in loaded if m == "edge.serving" or m.startswith("edge.serving.")}, sorted(loaded)

"""`make demo`'s job, `cloud-aggregator demo`, run as a user runs it: the real CLI, real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _require_mosquitto


def run_demo_cli(workdir: Path, *args: str, timeout: float = 240) -> str:
    cli = Path(sys.executable).with_name("cloud-aggregator")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "cloud_aggregator.cli"]
    done = subprocess.run(
        [*cmd, "demo", "--workdir", str(workdir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


CANDIDATES = ("personal", "global", "alone")


def fleet_means(out: str) -> tuple[float, float, float]:
    """(PFL-DA, indiv, FedAvg) from the demo's closing `fleet mean` line (its served column skipped)."""
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("fleet mean"))
    pflda, _served, indiv, fedavg = (float(v) for v in line.split()[2:6])
    return pflda, indiv, fedavg


def kept(cell: str, round_: int) -> bool:
    """A served cell's candidate: a name, or ``name@k`` for the model of an earlier round k the gate kept."""
    name, _, k = cell.partition("@")
    return name in CANDIDATES and (not k or 1 <= int(k) < round_)


def served_table(out: str) -> dict[str, tuple[float, float, str, float]]:
    """printer -> (PFL-DA's personal loss, the served model's, its candidate, indiv's) from the final table."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Final test loss per printer")) + 2
    rows = {}
    for ln in lines[start:]:
        if ln.strip().startswith("fleet mean"):
            break
        name, pflda, served, candidate, indiv, *_ = ln.split()
        rows[name] = (float(pflda), float(served), candidate, float(indiv))
    return rows


def newcomer_table(out: str) -> dict[int, tuple[float, str]]:
    """rounds since joining -> (the newcomer's served loss, its candidate)."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if "test loss after joining" in ln) + 2
    rows = {}
    for ln in lines[start:]:
        if not ln.strip():
            break
        r, _pflda, served, candidate, *_ = ln.split()
        rows[int(r)] = (float(served), candidate)
    return rows


def advice_table(out: str) -> dict[str, tuple[float, float, float]]:
    """printer -> (PFL-DA, indiv, truth) from the speed advice table after the final one."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Speed advice (mm/s)")) + 2
    rows = {}
    for ln in lines[start:]:
        if not ln.strip():
            break
        name, *cells = ln.split()
        rows[name] = tuple(float(c) for c in cells)
    return rows


def welder_table(out: str) -> dict[str, dict[str, int | None]]:
    """welder -> its weld numbers (wear starts, first worn, alert raised, worn label lands; None: never)."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Two simulated welders")) + 2
    rows = {}
    for ln in lines[start:]:
        if not ln.strip():
            break
        name, _material, *welds, _accuracy = ln.split()
        keys = ("wear", "first_worn", "alert", "worn_label")
        rows[name] = {k: None if w == "-" else int(w) for k, w in zip(keys, welds, strict=True)}
    return rows


def check_welders(out: str) -> None:
    """The wearing welder's alert is raised once wear starts and before the log's first worn label; the
    other welder raises none."""
    welders = welder_table(out)
    wearing, steady = welders["welder1"], welders["welder2"]
    assert wearing["wear"] is not None and wearing["alert"] is not None and wearing["worn_label"] is not None
    assert wearing["wear"] <= wearing["first_worn"] <= wearing["alert"] < wearing["worn_label"], welders
    assert steady == {"wear": None, "first_worn": None, "alert": None, "worn_label": None}, welders


def test_default_demo_on_mosquitto_shows_pflda_beating_indiv(tmp_path):
    _require_mosquitto()
    out = run_demo_cli(tmp_path)
    assert "broker: mosquitto" in out
    rows = [ln for ln in out.splitlines() if ln.split()[:2] and ln.split()[1:2] == ["4"]]
    # A summary, not a 200-row table: PFL-DA's first, every 10th and last round, then indiv every 10th.
    assert len(rows) == 21 + 20, "\n".join(rows)
    assert [int(r.split()[0]) for r in rows[:21]] == [1, *range(10, 201, 10)]
    pflda, indiv, _ = fleet_means(out)
    assert pflda < indiv, out[-1500:]
    # Each printer reports, in its round report, what it serves: a named candidate and its test loss.
    served = served_table(out)
    assert sorted(served) == ["printer1", "printer2", "printer3", "printer4"], out[-3000:]
    assert all(kept(c, 200) and 0 < s < 1000 for _, s, c, _ in served.values()), served
    # The printers' rows never change in the demo: a model an earlier round's rows chose is not kept
    # on those same rows against the round's own candidates (gate.refusal's ``stale``), so every
    # printer serves its last round's, and the fleet serves better than it would alone (it served
    # 0.4185 against indiv's 0.3083 while printer3 kept its round-28 model to the end).
    assert all("@" not in c for _, _, c, _ in served.values()), served
    assert sum(s for _, s, _, _ in served.values()) / len(served) < indiv, served
    newcomer = newcomer_table(out)
    assert sorted(newcomer) == [1, 5, 20], newcomer
    assert all(kept(c, 200 + r) and "@" not in c for r, (_, c) in newcomer.items()), newcomer
    check_welders(out)
    # Every round got every printer's upload: nothing refused, no deadline extended.
    log = (tmp_path / "aggregator.log").read_text()
    assert "dropped update" not in log and "extending the deadline" not in log, log[-3000:]


def test_demo_on_the_embedded_amqtt_broker(tmp_path):
    """The fallback where mosquitto is not installed: MQTT 3.1.1 through amqtt."""
    pytest.importorskip("amqtt")
    out = run_demo_cli(tmp_path, "--prefer-broker", "amqtt", "--devices", "3", "--rounds", "30")
    assert "broker: amqtt" in out
    assert all(v == v for v in fleet_means(out))  # three numbers, none NaN: every task finished
    # After the final table: each printer's speed advice from PFL-DA's and its alone-trained model.
    advice = advice_table(out)
    assert sorted(advice) == ["printer1", "printer2", "printer3"]
    assert all(len(v) == 3 and min(v) > 0 and max(v) < 200 for v in advice.values()), advice
    check_welders(out)  # the demo ends with the two welders
    log = (tmp_path / "aggregator.log").read_text()
    assert "abandoned" not in log and "extending the deadline" not in log, log[-3000:]


def test_a_terminated_demo_stops_its_broker_and_fleet(tmp_path):
    """SIGTERM (`timeout`, a service manager) unwinds like Ctrl-C: nothing is left running."""
    import signal
    import socket
    import time

    _require_mosquitto()
    cli = Path(sys.executable).with_name("cloud-aggregator")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "cloud_aggregator.cli"]
    proc = subprocess.Popen(
        [*cmd, "demo", "--workdir", str(tmp_path), "--rounds", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = proc.stdout.readline()  # "broker: mosquitto on mqtt://127.0.0.1:PORT"
    port = int(first.rsplit(":", 1)[1])
    deadline = time.monotonic() + 60
    while "round" not in proc.stdout.readline() and time.monotonic() < deadline:
        pass  # wait until the fleet is training
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]

    def ours() -> list[str]:
        out = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(tmp_path) in text:
                out.append(text)
        return out

    deadline = time.monotonic() + 10
    while ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ours()
    with socket.socket() as s, pytest.raises(OSError):
        s.settimeout(1.0)
        s.connect(("127.0.0.1", port))


def test_interrupt_on_sigterm_lets_a_benchmark_stop_its_broker(tmp_path):
    """The benchmarks that start a fleet (round_overhead, model_push, reliability) call
    ``interrupt_on_sigterm``: a SIGTERMed one leaves its ``LocalFleet`` block and the broker goes."""
    import signal
    import socket

    _require_mosquitto()
    script = (
        "import time\n"
        "from cloud_aggregator.local.broker import interrupt_on_sigterm\n"
        "from cloud_aggregator.local.fleet import LocalFleet\n"
        "interrupt_on_sigterm()\n"
        f"with LocalFleet.start({str(tmp_path)!r}) as fleet:\n"
        "    print(fleet.broker.port, flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    port = int(proc.stdout.readline())
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # listening
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0 and "KeyboardInterrupt: signal 15" in err, err[-2000:]
    with socket.socket() as s, pytest.raises(OSError):
        s.settimeout(1.0)
        s.connect(("127.0.0.1", port))

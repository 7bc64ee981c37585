"""No argv and no TOML document makes a console script print a traceback.

Each script's ``main(argv)`` runs in-process with stderr captured: only ``SystemExit`` (argparse)
may escape, and stderr never holds "Traceback".  Nothing long-running starts: the daemons'
loops and ``serve``/``demo`` are replaced by stubs that return at once, so a drawn argv stops
at validation or right where the service would begin; every broker a draw can name is a closed
port on loopback, and every state folder is a temporary one.
"""

from __future__ import annotations

import contextlib
import io
import logging
import signal
import tempfile
from pathlib import Path
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

import cloud_aggregator.cli as cloud_cli
import edge.cli as trainer_cli
import edge.recording.cli as recorder_cli
from tests.budget import examples

FRAGMENTS = [
    'broker = "mqtt://127.0.0.1:9"',
    'broker = "mqtts://127.0.0.1:9"',
    'broker = "tcp://127.0.0.1:9"',
    'broker = "127.0.0.1:9"',
    "allow_plaintext = true",
    "allow_plaintext = 3",
    'fleet = "f"',
    "rounds = -1",
    "state_dir = 5",
    '[tls]\nca_file = "/nonexistent/ca.pem"',
    '[tls]\ncert_file = "c.pem"',
    '[data]\nsource = "simulate-printer"',
    '[data]\nsource = "nowhere"',
    '[sensors]\nkind = "printer"',
    '[sensors]\nkind = "welder"',
    '[sensors]\nkind = "printer"\naccel = "adxl999"',
    '[model]\npublic_key = "/nonexistent.pem"',
    '[[task]]\nname = "t"\nalgorithm = "fedavg"\nmodel = "linear"\nmodel_args = {n_in = 1, n_out = 1}',
    '[[task]]\nname = "t"\nalgorithm = "pfl-da"\nmodel = "nosuch"',
    "[[task]]\nname = 3",
    "x = [",
    "[[task]]",
    "= nonsense",
]

TOML_DOCS = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=4).map("\n".join),
    st.text(max_size=60),
)

COMMON = [
    ["--broker", "mqtt://127.0.0.1:9"],
    ["--broker", "mqtts://127.0.0.1:9"],
    ["--broker", "tcp://127.0.0.1:9"],
    ["--broker", "127.0.0.1:9"],
    ["--broker", ""],
    ["--allow-plaintext"],
    ["--log-level", "ERROR"],
    ["--log-level", "LOUD"],
    ["--bogus"],
    ["extra"],
]
TRAINER_FLAGS = [
    *COMMON,
    ["--simulate", "printer"],
    ["--simulate", "lathe"],
    ["--fleet", "f"],
    ["--model-key", "/nonexistent.pem"],
]
RECORDER_FLAGS = [
    *COMMON,
    ["--simulate", "printer"],
    ["--layers", "0"],
    ["--layers", "x"],
    ["--layer-s", "-1"],
]
CLOUD_COMMANDS = [
    ["serve"],
    ["serve", "--service"],
    ["serve", "--restart", "t"],
    ["demo"],
    ["fleet"],
    ["nosuch"],
    [],
]


class _Trainer:
    """Stands in for ``EdgeTrainer``: built from a validated config, its loop returns at once."""

    def __init__(self, config: object) -> None:
        self.config = config

    def run(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _stubs() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(trainer_cli, "EdgeTrainer", _Trainer))
    stack.enter_context(mock.patch.object(recorder_cli, "run_until_signalled", lambda *a, **k: None))
    stack.enter_context(mock.patch.object(cloud_cli, "serve", lambda *a, **k: None))
    stack.enter_context(mock.patch.object(cloud_cli, "run_demo", lambda *a, **k: 0))
    return stack


def run_main(main, argv: list[str], toml: str) -> str:
    """``main(argv + --config FILE)`` with ``toml`` in FILE, in a fresh folder; its stderr."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    root = logging.getLogger()
    saved = root.handlers[:]
    err = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, _stubs(), contextlib.chdir(tmp):
        cfg = Path(tmp) / "config.toml"
        cfg.write_text(toml)
        root.handlers = []  # so a script's logging.basicConfig writes to the captured stderr
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                main([*argv, "--state-dir", str(Path(tmp) / "state"), "--config", str(cfg)])
        except SystemExit:
            pass
        finally:
            root.handlers = saved
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return err.getvalue()


def _argv(flags: list[list[str]]) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(flags), max_size=4).map(lambda parts: [a for p in parts for a in p])


@settings(max_examples=examples(30), deadline=None)
@given(argv=_argv(TRAINER_FLAGS), toml=TOML_DOCS, device=st.sampled_from(["printer3", "", "a/b"]))
def test_edge_trainer_never_prints_a_traceback(argv, toml, device):
    err = run_main(trainer_cli.main, ["--device", device, *argv], toml)
    assert "Traceback" not in err, err


@settings(max_examples=examples(30), deadline=None)
@given(argv=_argv(RECORDER_FLAGS), toml=TOML_DOCS, device=st.sampled_from(["printer3", ""]))
def test_edge_recorder_never_prints_a_traceback(argv, toml, device):
    err = run_main(recorder_cli.main, ["--device", device, *argv], toml)
    assert "Traceback" not in err, err


@settings(max_examples=examples(30), deadline=None)
@given(command=st.sampled_from(CLOUD_COMMANDS), argv=_argv(COMMON), toml=TOML_DOCS)
def test_cloud_aggregator_never_prints_a_traceback(command, argv, toml):
    err = run_main(cloud_cli.main, [*command, *argv], toml)
    assert "Traceback" not in err, err

"""``edge-trainer``: the device daemon's command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from edge import optout
from edge.cli_common import device_toml, setup_logging
from edge.config import DeviceConfig
from edge.daemon import EdgeTrainer
from edge.serving import predict
from edge.swarm import Swarm
from ioft_protocol.cli import check_broker_login, entry_point, flags_over_toml
from ioft_protocol.config import ConfigError, build, load_toml

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="edge-trainer",
        description="ioft device daemon: trains this machine's personalized model with its fleet over MQTT.",
        epilog="The device's owner opts out and back in, the daemon running: "
        "edge-trainer pause|resume --config FILE [--note TEXT]. One-off answers from the serving "
        "models: edge-trainer predict --config FILE ROWS_OR_WELD_FILE.",
    )
    p.add_argument("--device", required=True, help="this device's id, e.g. printer3")
    p.add_argument("--config", type=Path, help="TOML config file (CLI flags override it)")
    p.add_argument("--state-dir", help="where local state and data live (default /var/lib/ioft/<device>)")
    p.add_argument("--broker", help="mqtt://host:port or mqtts://host:port")
    p.add_argument("--fleet", help="fleet id")
    p.add_argument(
        "--simulate",
        choices=["printer", "welder", "printer-raw"],
        help="use a simulated machine as the data source (printer-raw: raw vibration windows); a printer "
        "or welder also keeps recording, through edge-recorder's path, so its rows are answered",
    )
    p.add_argument(
        "--model-key", help="the fleet's Ed25519 public key (PEM): accept signed ONNX model pushes"
    )
    p.add_argument(
        "--allow-plaintext", action="store_true", help="accept an unencrypted broker (loopback/tests)"
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--swarm",
        type=int,
        metavar="N",
        help="run N virtual devices in this process (ids <device>00000...; state in <state-dir>/<id>; edge.swarm)",
    )
    p.add_argument(
        "--swarm-first", type=int, default=0, metavar="K", help="number of the swarm's first device"
    )
    from edge.recording.simulate_live import add_arguments as add_simulation_arguments

    add_simulation_arguments(p, trainer=True)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> DeviceConfig:
    raw = flags_over_toml(
        device_toml(args.config, args.device, args.state_dir), args, "broker", "fleet", "allow_plaintext"
    )
    if args.simulate:
        raw.setdefault("data", {})["source"] = f"simulate-{args.simulate}"
        from edge.recording.simulate_live import simulated_toml

        simulated_toml(raw, args.simulate)
    if args.model_key:
        raw.setdefault("model", {})["public_key"] = args.model_key
    return build(DeviceConfig, raw, str(args.config or "command line"))


def rehearsal(config: DeviceConfig, args: argparse.Namespace):
    """``--simulate printer|welder``: the simulated history, then live rows through the recorder's path.

    The dataset is created from the simulator once (:func:`edge.dataset.prepare_dataset`); a
    :class:`~edge.recording.simulate.LiveSimulation` then records on beside the trainer, which
    reads it as it reads edge-recorder's (``[data] source = "state"``), so its rows are answered.

    Returns
    -------
    tuple
        The config to run (``kind`` kept, the dataset read from the state folder) and the
        simulation to start, or ``config`` and ``None`` where nothing records live (a group-S welder).

    Raises
    ------
    ConfigError
        A dataset in the state folder from another source, or a bad simulation flag.
    """
    from edge.dataset import prepare_dataset
    from edge.recording.base import RecorderError
    from edge.recording.simulate_live import LiveSimulation

    if args.simulate == "welder" and config.data.welder_group != "M":
        log.warning(
            "%s: [data] welder_group = S is simulated once, not live: no rows to answer", config.device
        )
        return config, None
    state_dir = Path(config.state_dir)
    try:
        _, _, meta = prepare_dataset(state_dir, config.device, config.data)
        if meta.get("source") != config.data.source:
            raise RecorderError(
                f"{state_dir} holds rows from {meta.get('source')!r}, not {config.data.source!r}: "
                "give --simulate its own --state-dir"
            )
        live = LiveSimulation(args.simulate, config.device, state_dir, args, config.data.source, meta)
    except RecorderError as exc:
        raise ConfigError("--simulate", [str(exc)]) from None
    data = dataclasses.replace(config.data, source="state")
    return dataclasses.replace(config, kind=config.machine_kind, data=data), live


def certificate_name(cert_file: str) -> str:
    """The common name (CN) of the PEM certificate in ``cert_file``: the identity the broker sees.

    Raises
    ------
    ConfigError
        If the file cannot be read, is not a PEM certificate, or has no CN.
    """
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(cert_file, [f"tls.cert_file: not a readable PEM certificate ({exc})"]) from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise ConfigError(cert_file, ["tls.cert_file: the certificate has no common name (CN)"])
    return str(names[0].value)


def check_identity(config: DeviceConfig) -> None:
    """Refuse a device id that is not its certificate's name.

    The fleet's broker takes the certificate's CN as username and client id, so a daemon
    started as ``printer9`` with ``printer1``'s certificate would speak as printer1 and knock
    the real printer1 off the broker every second (and its uplinks as printer9 are refused).

    Raises
    ------
    ConfigError
        Naming both names and the way forward.
    """
    if config.tls is None or config.tls.cert_file is None:
        return
    cn = certificate_name(config.tls.cert_file)
    if cn != config.device:
        raise ConfigError(
            config.tls.cert_file,
            [
                f"--device {config.device} does not match tls.cert_file {config.tls.cert_file}, which is "
                f"{cn!r}'s certificate (the broker would take this daemon for {cn}): start it with "
                f"--device {cn}, or give {config.device}'s own device.toml (`fleet init` writes one per device)"
            ],
        )


def pause_or_resume(argv: list[str]) -> int:
    """``edge-trainer pause|resume --config FILE``: the owner's opt-out (:mod:`edge.optout`)."""
    p = argparse.ArgumentParser(
        prog="edge-trainer",
        description="pause: the running daemon stops taking part (and says so in its status); resume: it "
        "takes part again. The daemon keeps running either way.",
    )
    optout.add_arguments(p)
    args = p.parse_args(argv)
    raw = load_toml(args.config) if args.config else {}
    return optout.run(args, raw)


def run_swarm(config: DeviceConfig, count: int, first: int) -> int:
    """``--swarm N``: N virtual devices in this process until SIGTERM/SIGINT (``edge.swarm``)."""
    try:
        swarm = Swarm(config, count, first)
    except ValueError as exc:
        raise ConfigError("--swarm", [str(exc)]) from None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: swarm.stop())
    swarm.run()
    return 0


def predict_rows(argv: list[str]) -> int:
    """``edge-trainer predict --config FILE ROWS_OR_WELD_FILE`` (:mod:`edge.serving.predict`)."""
    p = argparse.ArgumentParser(
        prog="edge-trainer", description="predict: one answer per row (JSON lines) from the serving models."
    )
    predict.add_arguments(p)
    return predict.run(p.parse_intermixed_args(argv))  # "predict" and the optional input, flags between


@entry_point("edge-trainer", mistakes=(predict.PredictError,))
def main(argv: list[str] | None = None) -> int:
    """Run the device daemon until SIGTERM/SIGINT; a user mistake is one line and exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in optout.COMMANDS:
        return pause_or_resume(argv)
    if argv and argv[0] == "predict":
        return predict_rows(argv)
    args = parse_args(argv)
    setup_logging(args.log_level, args.device)
    config = config_from_args(args)
    source = (
        str(args.config)
        if args.config
        else "the command line (no --config: give the device.toml `fleet init` wrote)"
    )
    check_broker_login(config, config.device, source)
    check_identity(config)  # a twin of another device: refused before it connects
    if args.swarm is not None:
        return run_swarm(config, args.swarm, args.swarm_first)
    live = None
    if args.simulate in ("printer", "welder") and not args.no_live:
        config, live = rehearsal(config, args)
    trainer = EdgeTrainer(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: trainer.stop())
    if live is not None:
        live.start()
    try:
        trainer.run()
    finally:
        if live is not None:
            live.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

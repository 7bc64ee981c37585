"""``cloud-aggregator keygen``: the fleet's Ed25519 signing key pair.

``backbone train`` and ``export`` need the cloud's backbones and store, so they live in
:mod:`cloud_aggregator.models.backbones.cli`; this package imports nothing of the cloud's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from export.keys import generate_keypair


def _keygen(args: argparse.Namespace) -> int:
    try:
        private, public = generate_keypair(args.out, overwrite=args.rotate)
    except FileExistsError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"private key {private} (keep it with the operator); public key {public} (copy to every device)")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``keygen`` to the ``cloud-aggregator`` subcommands."""
    k = sub.add_parser("keygen", help="create the fleet's Ed25519 signing key pair")
    k.add_argument(
        "--out", type=Path, required=True, help="private key path; the public key goes beside it (.pub)"
    )
    k.add_argument("--rotate", action="store_true", help="replace an existing key pair")
    k.set_defaults(func=_keygen)

"""The key fleetctl signs with, checked against the nodes' keys before anything is sent.

A node's own key (its approved key in ``fleet_trust``) signing a command, a maintenance
window, a forget or a policy request is a mistake (nodes refuse it unless it is also in
their ``trust_operators``) or a hazard (whoever reads that node's disk could then sign
as an operator). fleetctl cannot see the agents' and aggregators' ``trust_operators``;
it reads its own copy of that list (``trust_operators``, ``trust_operators_file``: the
settings of :class:`actors.cli.common.ClientConfig`, read as the agents read theirs).
A key on it is signed with, no question asked; any other key that is a node's own is
warned about and refused unless ``--sign-with-node-key`` says it is meant to be an
operator's too. The check reads every trust entry (one batched direct get a page: about
0.5 MB per thousand nodes), within :data:`SCAN_TIMEOUT`; a fleet it cannot read in time
is warned about, not refused.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import nats.errors

from actors.cli.common import (
    CLIENT_ENV_PREFIX,
    KEY_FILE_ENV,
    ClientConfig,
    add_server,
    default_operator_key,
    flag_name,
    settings_from,
)
from actors.cli.parsing import duration
from actors.fleet.storage import registry
from actors.runtime.bus import Bus, NotProvisioned
from actors.runtime.config import read_keys
from schemas import signing
from schemas.errors import DecodeError, FleetError
from schemas.subjects import Subjects

SCAN_TIMEOUT = 10.0
"""Seconds the trust entries may take to read before the check gives up (warning)."""


NODE_KEY_FLAG = "--sign-with-node-key"


def add_signing_check(parser: argparse.ArgumentParser) -> None:
    """The flags of :func:`check_signer`: the operator trust list and the consent to sign
    with a node's own key."""
    parser.add_argument(
        NODE_KEY_FLAG,
        action="store_true",
        help="sign even if the key is a node's own approved key and not on the operator "
        "trust list below (it must then also be in the nodes' and aggregators' "
        "trust_operators)",
    )
    parser.add_argument(
        flag_name("trust_operators"),
        dest="trust_operators",
        action="append",
        metavar="KEY",
        help="an operator public key the fleet trusts, as the agents' trust_operators "
        "(repeatable; env FLEETCTL_TRUST_OPERATORS): a signing key listed is signed with "
        "though it is a node's own key, without a warning",
    )
    parser.add_argument(
        "--trust-operators-file",
        help="a file of such keys, one a line (# comments), as the agents' "
        "trust_operators_file (env FLEETCTL_TRUST_OPERATORS_FILE)",
    )


def trusted_operators(args: argparse.Namespace) -> set[str]:
    """The operator keys the fleet trusts as fleetctl's settings list them, read as the
    agents and aggregators read theirs."""
    config = settings_from(args, ClientConfig, CLIENT_ENV_PREFIX)
    return read_keys(config.trust_operators, config.trust_operators_file)


async def check_signer(
    bus: Bus, subjects: Subjects, key: signing.KeyPair, args: argparse.Namespace
) -> None:
    """Warn on stderr, and raise FleetError unless ``--sign-with-node-key``, when ``key``
    is the approved key of a node in ``fleet_trust`` and not a trusted operator key
    (:func:`trusted_operators`)."""
    if key.public_key in trusted_operators(args):
        return
    try:
        async with asyncio.timeout(SCAN_TIMEOUT):
            entries = await registry.read_trust(bus, subjects)
    except (nats.errors.Error, TimeoutError, NotProvisioned, DecodeError) as exc:
        sys.stderr.write(
            f"warning: could not check whether the signing key is a node's own: {exc}\n"
        )
        return
    nodes = [entry.node_id for entry in entries if registry.approved_key(entry) == key.public_key]
    if not nodes:
        return
    more = f" (and {len(nodes) - 1} more nodes')" if len(nodes) > 1 else ""
    problem = (
        f"the signing key {signing.fingerprint(key.public_key)} is node {nodes[0]}'s own "
        f"key{more}: nodes refuse it unless it is also in their trust_operators, and "
        "whoever reads that node's disk can sign with it"
    )
    if args.sign_with_node_key:
        sys.stderr.write(f"warning: {problem}; signing with it anyway ({NODE_KEY_FLAG})\n")
        return
    raise FleetError(
        f"{problem}; sign with an operator key (fleetctl keys init, --key-file), list it "
        f"with --trust-operator if it is a trusted operator key too, or pass {NODE_KEY_FLAG}"
    )


def add_request_signing(parser: argparse.ArgumentParser) -> None:
    """A signed request's flags (policy, maintenance): its key, the wait for an
    aggregator's answer, the signing check's, the server."""
    parser.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"operator key that signs the request (env {KEY_FILE_ENV}; default "
        f"{default_operator_key()})",
    )
    parser.add_argument(
        "--timeout",
        type=duration,
        default=10.0,
        help="how long to wait for an aggregator's answer (default 10s)",
    )
    add_signing_check(parser)
    add_server(parser)

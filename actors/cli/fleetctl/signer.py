"""The key fleetctl signs with, checked against the nodes' keys before anything is sent.

A node's own key (its approved key in ``fleet_trust``) signing a command, a maintenance
window, a forget or a policy request is a mistake (nodes refuse it unless it is also in
their ``trust_operators``) or a hazard (whoever reads that node's disk could then sign
as an operator). fleetctl cannot see the agents' and aggregators' ``trust_operators``,
so it warns and refuses unless ``--yes`` says the key is meant to be an operator's too.
The check reads every trust entry (one batched direct get a page: about 0.5 MB per
thousand nodes), within :data:`SCAN_TIMEOUT`; a fleet it cannot read in time is warned
about, not refused.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import nats.errors

from actors.cli.common import KEY_FILE_ENV, add_server, default_operator_key
from actors.cli.parsing import duration
from actors.fleet.storage import registry
from actors.runtime.bus import Bus, NotProvisioned
from schemas import signing
from schemas.errors import DecodeError, FleetError
from schemas.subjects import Subjects

SCAN_TIMEOUT = 10.0
"""Seconds the trust entries may take to read before the check gives up (warning)."""


def add_yes(parser: argparse.ArgumentParser) -> None:
    """``--yes``: sign even with a key that is a node's own."""
    parser.add_argument(
        "--yes",
        action="store_true",
        help="sign even if the key is a node's own approved key (it must then also be in "
        "the nodes' and aggregators' trust_operators)",
    )


async def check_signer(bus: Bus, subjects: Subjects, key: signing.KeyPair, yes: bool) -> None:
    """Warn on stderr, and raise FleetError unless ``yes``, when ``key`` is the approved
    key of a node in ``fleet_trust``."""
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
    if yes:
        sys.stderr.write(f"warning: {problem}; signing with it anyway (--yes)\n")
        return
    raise FleetError(
        f"{problem}; sign with an operator key (fleetctl keys init, --key-file), or pass "
        "--yes if this key is a trusted operator key too"
    )


def add_request_signing(parser: argparse.ArgumentParser) -> None:
    """A signed request's flags (policy, maintenance): its key, the wait for an
    aggregator's answer, ``--yes``, the server."""
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
    add_yes(parser)
    add_server(parser)

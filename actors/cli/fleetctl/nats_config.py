"""``fleetctl nats-config``: the nats-server accounts block of a fleet, rendered by
:mod:`actors.fleet.storage.nats_config`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from actors.cli.common import add_server, connected
from actors.fleet.live import reader as live
from actors.fleet.storage import nats_config
from schemas.subjects import Subjects


async def cmd_nats_config(args: argparse.Namespace) -> int:
    """Print (or write) the accounts block of the fleet's servers: nodes from ``--nodes``,
    else every approved node in ``fleet_trust``."""
    subjects = Subjects(args.prefix)
    if args.nodes is not None:
        nodes = nats_config.parse_nodes(args.nodes.read_text())
    else:
        async with connected(args, "fleetctl") as bus:
            clusters = {r.node_id: r.cluster for r in await live.stored_records(bus, subjects)}
            nodes = await nats_config.approved_nodes(bus, subjects, clusters, args.cluster or "")
    users = nats_config.Users(
        nodes=nodes,
        aggregators=args.aggregator or [],
        operators=args.operator or [],
        monitors=args.monitor or [],
    )
    text = nats_config.render(subjects, users, args.identity)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        sys.stderr.write(f"{len(nodes)} node users written to {args.output}\n")
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``nats-config`` to fleetctl's subcommands."""
    config = commands.add_parser(
        "nats-config",
        help="generate the nats-server accounts block (per-node users and permissions)",
        description="Nodes come from --nodes, else from the approved keys in fleet_trust.",
    )
    config.add_argument(
        "--nodes", type=Path, help="file of 'node cluster public_key' lines (no connection)"
    )
    config.add_argument("--cluster", help="cluster of approved nodes that have no record yet")
    config.add_argument("--aggregator", action="append", help="aggregator public key (repeatable)")
    config.add_argument("--operator", action="append", help="operator public key (repeatable)")
    config.add_argument(
        "--monitor",
        action="append",
        help="read-only monitoring public key (repeatable): account MONITORS, node records "
        "by direct get with the JetStream API prefix JS.FLEET.API, alerts and events",
    )
    config.add_argument(
        "--identity",
        choices=["nkey", "cert"],
        default="nkey",
        help=f"nodes log in with their nkey, or a client certificate whose email SAN is "
        f"<node>@{nats_config.CERT_DOMAIN} (server tls verify_and_map); default nkey",
    )
    config.add_argument("--output", type=Path, help="write here instead of stdout")
    add_server(config)
    config.set_defaults(func=cmd_nats_config)

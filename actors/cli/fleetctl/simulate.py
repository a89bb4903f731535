"""``fleetctl simulate``: its flags, checked, and the run (:mod:`actors.cli.simulate`)."""

from __future__ import annotations

import argparse
import sys

from actors.cli.common import CLIENT_ENV_PREFIX, ClientConfig, add_server, connected, settings_from
from actors.cli.parsing import duration, fail
from actors.cli.simulate.publisher import SimOptions
from actors.cli.simulate.run import simulate
from schemas.subjects import check_token


async def cmd_simulate(args: argparse.Namespace) -> int:
    if args.nodes < 1 or (args.rate is not None and args.rate <= 0) or args.duration <= 0:
        return fail("simulate: --nodes, --rate and --duration must be positive")
    check_token("cluster", args.cluster)
    options = SimOptions(
        nodes=args.nodes,
        rate=args.rate or args.nodes / 10.0,
        duration=args.duration,
        cluster=args.cluster,
        gpus=args.gpus,
        prefix=args.prefix,
        wait=args.wait,
        kill=args.kill,
        processes=args.processes,
    )
    if not 0 <= args.kill <= args.nodes:
        return fail("simulate: --kill must be between 0 and --nodes")
    if not 1 <= args.processes <= args.nodes:
        return fail("simulate: --processes must be between 1 and --nodes")
    client = settings_from(args, ClientConfig, CLIENT_ENV_PREFIX)
    async with connected(args, "fleetctl-simulate") as bus:
        return await simulate(bus, options, sys.stdout, client)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``simulate`` to fleetctl's subcommands."""
    sim = commands.add_parser(
        "simulate",
        help="fleet simulator / aggregator benchmark",
        description="N signed simulated nodes beat at --rate in all for --duration; prints "
        "the publish rate, when every record carries its node's last seq, and the "
        "publish-to-record latency p50/p99 of each node's FIRST heartbeat of the run: from "
        "that heartbeat's ts to this command's KV watch seeing the fleet_nodes record "
        "written from it (a new boot is a state change, so it is written at once; later "
        "heartbeats reach fleet_nodes only at checkpoints and are not measured).",
    )
    sim.add_argument("--nodes", type=int, required=True, help="how many simulated nodes (required)")
    sim.add_argument("--rate", type=float, default=None, help="heartbeats/s in all (N / 10)")
    sim.add_argument("--duration", type=duration, default=30.0, help="how long (default 30s)")
    sim.add_argument("--cluster", default="sim", help="their cluster (default sim)")
    sim.add_argument("--gpus", type=int, default=8, help="fake GPUs per node (default 8)")
    sim.add_argument(
        "--wait",
        type=duration,
        default=60.0,
        help="catch-up bound after the last publish (default 60s)",
    )
    sim.add_argument(
        "--kill",
        type=int,
        default=0,
        help="stop this many nodes at once half way (a stale storm): reports their alerts",
    )
    sim.add_argument(
        "--processes",
        type=int,
        default=1,
        help="worker processes that sign and publish, each every P-th node (default 1: "
        "this one); this process follows the records and prints the figures",
    )
    add_server(sim)
    sim.set_defaults(func=cmd_simulate)

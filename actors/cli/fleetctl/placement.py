"""``fleetctl deploy NAME`` without a node (the fleet chooses the nodes), ``fleetctl
undeploy NAME``, and the placed replicas that ``fleetctl workloads`` lists.

A placed deploy reads the nodes live (their latest accepted heartbeats: what each can
run, its health, its free GPUs; the maintenance windows) and every placed workload,
chooses a node for each replica (:mod:`actors.fleet.placement.choose`), creates the
workload's record in
``fleet_workloads`` (it fails if the name is placed already) and only then sends each
chosen node its signed Deploy. Replicas no node fits stay pending, with the reason; an
aggregator running the workload reconciler places them when a node fits and keeps every
replica running from then on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

import msgspec
import nats.js.errors

from actors.cli.common import KEY_FILE_ENV, add_server, connected, default_operator_key
from actors.cli.fleetctl.rolling import cmd_one_or_rolling, positive_int
from actors.cli.fleetctl.send import EXIT_DONE, EXIT_FAILED, EXIT_TIMEOUT
from actors.cli.parsing import fail
from actors.fleet.labels import parse_selectors
from actors.fleet.live import reader as live
from actors.fleet.operator.commands import new_command, publish_command
from actors.fleet.placement import store
from actors.fleet.placement.choose import choose, taken_by
from actors.fleet.placement.reconcile import FAILED_STATES, deploy_order
from actors.fleet.storage import registry
from actors.fleet.storage.placed import listed, read_all
from actors.runtime.bus import Bus
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.messages import NodeRecord
from schemas.placement import MAX_REPLICAS, PlacedWorkload, Replica, spec_body
from schemas.subjects import BUCKET_WORKLOADS, Subjects
from schemas.workloads import Deploy, Stop

WAIT_POLL = 1.0


def size(text: str) -> int:
    """An argparse type: bytes, with an optional K, M, G or T suffix (powers of 1024)."""
    units = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    number, unit = text.strip().upper().rstrip("IB") or "0", 1
    if number[-1:] in units:
        number, unit = number[:-1], units[number[-1]]
    try:
        value = int(float(number) * unit)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 40G") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is not negative")
    return value


def replicas_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"at most {MAX_REPLICAS} replicas")
    return value


async def cmd_deploy(args: argparse.Namespace) -> int:
    """A node named, or ``-l`` without ``--replicas``: the deploy to nodes as before;
    otherwise the fleet places it."""
    if args.node is None and (args.replicas is not None or not args.label):
        return await cmd_place(args)
    if args.replicas is not None or args.gpu_memory:
        return fail("--replicas and --gpu-memory place the workload: give no node", 2)
    return await cmd_one_or_rolling(args)


def workload_of(args: argparse.Namespace, key: str) -> PlacedWorkload:
    if len(args.gpus) > 1:
        raise FleetError("without a node, --gpus is how many GPUs each replica needs (e.g. 2)")
    # The deploy a named node would get (every deploy option, --image included), less
    # the GPUs: each replica's node gets its own.
    built = args.build_action(args)
    assert isinstance(built, Deploy)
    deploy = msgspec.structs.replace(built, gpus=[], placed=True)
    return PlacedWorkload(
        name=args.name,
        deploy=deploy,
        gpus=args.gpus[0] if args.gpus else 0,
        gpu_memory=args.gpu_memory or 0,
        cluster=args.cluster or "",
        selector=dict(parse_selectors(args.label)),
        created_at=time.time(),
        created_by=key,
        updated_by="fleetctl",
    )


async def cmd_place(args: argparse.Namespace) -> int:
    key = signing.load_key_file(args.key_file or default_operator_key())
    workload = workload_of(args, key.public_key)
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        bucket = await bus.kv(subjects.bucket_name(BUCKET_WORKLOADS))
        placed = await read_all(bus, subjects)
        if args.name in placed:
            return fail(f"workload {args.name} is placed already (fleetctl undeploy it first)")
        fleet = await live.read_fleet(bus, subjects)
        records = {r.node_id: r for r in fleet}
        maintenance = {r.node_id: r.maintenance for r in fleet if r.maintenance}
        taken = taken_by(w for w, _ in placed.values())
        batch = uuid.uuid4().hex[:16]
        replicas: list[Replica] = []
        orders = []
        now = time.time()
        for index in range(args.replicas or 1):
            current = msgspec.structs.replace(workload, replicas=replicas)
            found = choose(current, records, taken, now=now, maintenance=maintenance)
            if isinstance(found, str):
                replicas.append(Replica(index=index, why=found))
                continue
            taken.add(found.node, found.gpus)
            command_id = f"{args.name}-{index}-{batch}"
            replicas.append(
                Replica(
                    index=index,
                    node=found.node,
                    cluster=found.cluster,
                    gpus=found.gpus,
                    deployed_at=time.time(),
                    command_id=command_id,
                    why=found.why,
                )
            )
            orders.append(deploy_order(workload, found, command_id, args.reason or "placed"))
        workload = msgspec.structs.replace(workload, replicas=replicas)
        spec = spec_body(workload)
        signature = key.headers(spec)[signing.HEADER_SIG]
        workload = msgspec.structs.replace(workload, spec=spec.decode(), spec_sig=signature)
        try:
            await bucket.create(args.name, codec.encode(workload))
        except nats.js.errors.KeyWrongLastSequenceError:
            return fail(f"workload {args.name} is placed already (fleetctl undeploy it first)")
        errors = await store.send(bus, subjects, key, orders)
        for replica in replicas:
            sys.stdout.write(replica_line(replica, args.why) + "\n")
        for error in errors:
            sys.stderr.write(f"deploy not sent: {error} (the reconciler tries again)\n")
        pending = sum(1 for r in replicas if not r.node)
        if pending:
            sys.stderr.write(
                f"{pending} of {len(replicas)} replicas pending: an aggregator running the "
                "workload reconciler places them when a node fits\n"
            )
        if not args.wait:
            return EXIT_DONE
        return await wait_ready(bus, subjects, args.name, args.timeout or args.ready_timeout + 60)


def replica_line(replica: Replica, why: bool) -> str:
    if replica.node:
        gpus = ",".join(map(str, replica.gpus)) or "none"
        line = (
            f"replica {replica.index}: {replica.node} GPUs {gpus} (deploy id={replica.command_id})"
        )
    else:
        line = f"replica {replica.index}: pending"
    if why or not replica.node:
        line += f"\n  why: {replica.why}"
    return line


async def replica_nodes(
    bus: Bus, subjects: Subjects, workload: PlacedWorkload
) -> dict[str, NodeRecord]:
    """The replicas' nodes, each with its latest accepted heartbeat (read live, node by
    node: a wait reads no other node)."""
    found: dict[str, NodeRecord] = {}
    for node in sorted({replica.node for replica in workload.replicas if replica.node}):
        try:
            found[node] = await live.read_node(bus, subjects, node)
        except registry.NotFound:
            continue
    return found


async def wait_ready(bus: Bus, subjects: Subjects, name: str, timeout: float) -> int:
    """Until every replica of ``name`` is ready where it is placed: 0; one failed: 1,
    after a line on stderr for each failed replica with its node and the node's reason;
    the timeout: 2. Each replica's state is printed as it changes (a pending one with
    why no node fits)."""
    deadline = time.monotonic() + timeout
    said: set[tuple[int, str]] = set()
    while time.monotonic() < deadline:
        placed = await read_all(bus, subjects)
        if name not in placed:
            return fail(f"workload {name} was undeployed")
        workload, _ = placed[name]
        records = await replica_nodes(bus, subjects, workload)
        ready = 0
        failed: list[str] = []
        for replica in workload.replicas:
            running = listed(records.get(replica.node), name) if replica.node else None
            state = running.state if running is not None else "pending"
            if (replica.index, f"{replica.node}:{state}") not in said:
                said.add((replica.index, f"{replica.node}:{state}"))
                why = f" ({replica.why})" if not replica.node and replica.why else ""
                sys.stdout.write(f"replica {replica.index}: {replica.node or '-'} {state}{why}\n")
                sys.stdout.flush()
            if running is not None and running.state in FAILED_STATES:
                reason = f": {running.reason}" if running.reason else ""
                failed.append(f"replica {replica.index} {running.state} on {replica.node}{reason}")
            ready += running is not None and running.state == "ready"
        if failed:
            for line in failed:
                sys.stderr.write(f"error: {line}\n")
            sys.stderr.write(
                "the reconciler moves failed replicas to other nodes (fleetctl workloads "
                f"--why {name} shows where)\n"
            )
            return EXIT_FAILED
        if ready == len(workload.replicas):
            return EXIT_DONE
        await asyncio.sleep(WAIT_POLL)
    return fail(f"not every replica ready within {timeout:g}s", EXIT_TIMEOUT)


async def cmd_undeploy(args: argparse.Namespace) -> int:
    """Delete the workload's record (compare-and-set: no reconciler moves it after), then
    stop every replica and every copy still to be stopped."""
    key = signing.load_key_file(args.key_file or default_operator_key())
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        bucket = await bus.kv(subjects.bucket_name(BUCKET_WORKLOADS))
        for _ in range(registry.CAS_ATTEMPTS):
            placed = await read_all(bus, subjects)
            if args.name not in placed:
                return fail(f"no placed workload named {args.name}")
            workload, revision = placed[args.name]
            try:
                await bucket.delete(args.name, last=revision)
                break
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        else:
            return fail(f"workload {args.name} kept changing; try again")
        nodes = {(r.node, r.cluster) for r in workload.replicas if r.node}
        nodes |= {(lo.node, lo.cluster) for lo in workload.leftovers}
        failed = 0
        for node, cluster in sorted(nodes):
            command = new_command(node, cluster, Stop(name=args.name), args.reason)
            try:
                await publish_command(bus, subjects, key, command)
                sys.stdout.write(f"stop sent: id={command.id} node={node}\n")
            except FleetError as exc:
                failed += 1
                sys.stderr.write(f"stop not sent to {node}: {exc}\n")
    return EXIT_FAILED if failed else EXIT_DONE


def placement_of(placed: list[PlacedWorkload], node: str, name: str) -> Replica | None:
    """The replica of a placed workload running as ``name`` on ``node``."""
    for workload in placed:
        if workload.name == name:
            return next((r for r in workload.replicas if r.node == node), None)
    return None


def unplaced(placed: list[PlacedWorkload], records: list[NodeRecord]) -> list[tuple[str, Replica]]:
    """Replicas no node reports yet (pending, or deployed and not listed): (name, replica)."""
    by_node = {record.node_id: record for record in records}
    return [
        (workload.name, replica)
        for workload in placed
        for replica in workload.replicas
        if not replica.node or listed(by_node.get(replica.node), workload.name) is None
    ]


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Placement's options on ``deploy``, ``--why`` on ``workloads``, and ``undeploy``."""
    deploy = commands.choices["deploy"]
    deploy.add_argument(
        "--replicas",
        type=replicas_count,
        default=None,
        help="without a node: replicas the fleet places on distinct nodes and keeps running "
        "(default 1); --gpus is then how many GPUs each needs",
    )
    deploy.add_argument(
        "--gpu-memory",
        type=size,
        default=0,
        help="without a node: free memory each GPU must have (e.g. 40G; default: not checked)",
    )
    deploy.add_argument(
        "--why", action="store_true", help="without a node: say why each node was chosen"
    )
    deploy.set_defaults(func=cmd_deploy)
    commands.choices["workloads"].add_argument(
        "--why", action="store_true", help="why each placed replica runs where it does"
    )
    undeploy = commands.add_parser(
        "undeploy",
        help="stop a workload the fleet placed, on every node, and forget it",
        description="Delete the placed workload's record (no aggregator moves it after) and "
        "send each of its nodes a signed Stop. Exit 1 if a stop could not be sent.",
    )
    undeploy.add_argument("name", help="the placed workload's name")
    undeploy.add_argument("--reason", default="", help="recorded with the stop commands")
    undeploy.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"operator key (env {KEY_FILE_ENV}; default {default_operator_key()})",
    )
    add_server(undeploy)
    undeploy.set_defaults(func=cmd_undeploy)

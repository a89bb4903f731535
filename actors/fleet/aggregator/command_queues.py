"""Every admitted node's command consumer on FLEET_CMD, created by the provider.

A node that could create its own consumer could create it with any configuration the
server takes under its name and filter: a push consumer delivering its commands into a
FLEET subject with listeners (``fleet.register``: one command became hundreds of
registrations a second). So under the shipped permissions nodes may only look their
consumer up, pull from it and acknowledge; the aggregator creates it, with the one
configuration :func:`actors.runtime.consumer.pull_config` pins (pull only, bounded
redeliveries, ack wait and pulls), for every node it owns whose record is admitted, and
puts back any that is missing or configured otherwise (deleted, or left from before).
What it checks each round is what changed: nodes newly admitted or owned, and consumers
the server says were deleted; the whole list only at start, after the connection was
regained (advisories sent while it was down are lost) and every :data:`LISTED_EVERY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from actors.runtime.bus import Bus
from actors.runtime.consumer import pull_config
from actors.runtime.schedule import stop_if_cancelled, take_turn
from actors.runtime.subscriptions import unsubscribe_quietly
from schemas.subjects import (
    COMMAND_ACK_WAIT,
    COMMAND_MAX_DELIVER,
    STREAM_COMMANDS,
    Subjects,
    command_consumer,
)

log = logging.getLogger(__name__)

ROUND_GAP = 0.2
"""Seconds between two rounds at least, however often records are written."""
NOT_ADMITTED = ("pending", "deregistered")
"""Record states whose node gets no command consumer (created when it is admitted)."""
Node = tuple[str, str]
"""(cluster, node)."""
Clusters = dict[str, str]
"""Node -> its cluster: the nodes a round checks and those whose consumer is in place,
each the node's interned name and its record's cluster (no pair, and no consumer's name,
made and kept per node: 100,000 pairs were 6 MB through a fresh fleet's first round)."""


class AdmittedNodes(Protocol):
    """The nodes whose command consumer should exist (admitted, owned), as the keeper
    asks the aggregator about them."""

    written: asyncio.Event
    """Set when a node's record is written: the keeper's next round comes then, not a
    whole round later (a node admitted takes commands at once)."""

    def every(self) -> Iterable[Node]:
        """Every such node."""
        ...

    def cluster(self, node: str) -> str | None:
        """The node's cluster if its consumer should exist now, else None."""
        ...

    def changed(self) -> Collection[str] | None:
        """The nodes whose records were written since the last call (a state change at
        once, the rest at their checkpoint); None when any node may have changed (a
        partition gained or lost, or too many written to keep their names)."""
        ...


PINNED = (
    "deliver_subject",
    "filter_subject",
    "ack_policy",
    "deliver_policy",
    "ack_wait",
    "max_deliver",
    "max_waiting",
    "max_ack_pending",
)
"""The fields a consumer in place must share with :func:`wanted` to be left alone."""
INFO_PAGE = 256
"""Consumers (with their configurations) the server lists per request; also the most
nodes a round asks about one by one (more are checked against a listing)."""
API_TIMEOUT = 5.0
CONSUMER_DELETED = "$JS.EVENT.ADVISORY.CONSUMER.DELETED"
"""The server's advisory that a consumer was deleted (``.<stream>.<consumer>``)."""
CREATE_BATCH = 64
"""Consumers created at once (their requests in flight together: about a third less of
the aggregator's CPU a consumer than one at a time)."""
DELETED_KEPT = 10_000
"""Deleted consumers' names remembered between two rounds (a bound: each is a name the
server sent; past it the next round checks every node)."""
LISTED_EVERY = 1800.0
"""Seconds between two listings of every consumer's name while the connection stays up:
the net for an advisory lost otherwise (dropped by a slow subscriber). A listing at
100,000 nodes costs the aggregator about half a second of CPU; one every two minutes was
a sixth to a third of its idle CPU (docs/performance.md, "Fleet-wide jobs at 100,000
nodes")."""
NODES_PER_TURN = 1000
"""Nodes a pass over every admitted node takes in one round of the event loop (a few
ms), so the aggregator's lease renewals and its connection's reader run between."""


def wanted(subjects: Subjects, cluster: str, node: str) -> ConsumerConfig:
    """The configuration of ``node``'s command consumer."""
    return pull_config(
        command_consumer(cluster, node),
        subjects.command(cluster, node),
        ack_wait=COMMAND_ACK_WAIT,
        max_deliver=COMMAND_MAX_DELIVER,
    )


def _differs(current: ConsumerConfig, config: ConsumerConfig) -> bool:
    return any(getattr(current, name) != getattr(config, name) for name in PINNED)


async def ensure(
    bus: Bus,
    subjects: Subjects,
    nodes: Mapping[str, str],
    *,
    check_configs: bool,
    done: Clusters | None = None,
) -> int:
    """Create the command consumer of each node of ``nodes`` (node -> cluster) that has
    none; with ``check_configs`` also one configured otherwise (deleted first). How many
    were created; each node whose consumer is in place is put in ``done`` as it is (a
    round that fails half way keeps what it did). Without ``check_configs`` only the
    consumers' names are listed (a few bytes each, where a configuration is about a
    kilobyte): nodes cannot configure one. ``nodes`` is walked with the event loop
    running between turns: the caller does not change it meanwhile."""
    stream = subjects.stream_name(STREAM_COMMANDS)
    current = await (
        _configs(bus.js, subjects, stream, nodes) if check_configs else _names(bus, stream)
    )
    return await _put_back(bus, subjects, stream, nodes, current, done)


async def _put_back(
    bus: Bus,
    subjects: Subjects,
    stream: str,
    nodes: Mapping[str, str],
    current: dict[str, ConsumerConfig | None],
    done: Clusters | None,
) -> int:
    """Create each node's consumer missing from ``current`` (name: its configuration,
    None when not read), and again one configured otherwise, :data:`CREATE_BATCH` at a
    time; how many were created. Each node is added to ``done`` once its consumer is in
    place."""
    done = {} if done is None else done
    missing: list[str] = []
    # The few found configured otherwise, apart: a (node, config) pair per node missing,
    # most nodes of a fresh fleet, held through its creates, was 7 MB at 100,000 nodes.
    otherwise: dict[str, ConsumerConfig] = {}
    for step, (node, cluster) in enumerate(nodes.items(), 1):
        await take_turn(step, NODES_PER_TURN)
        name = command_consumer(cluster, node)
        found = current.get(name)
        if name in current and (
            found is None or not _differs(found, wanted(subjects, cluster, node))
        ):
            done[node] = cluster
            continue
        missing.append(node)
        if found is not None:
            otherwise[node] = found
    for start in range(0, len(missing), CREATE_BATCH):
        batch = missing[start : start + CREATE_BATCH]
        await asyncio.gather(
            *(_create(bus, subjects, stream, nodes[n], n, otherwise.get(n), done) for n in batch)
        )
    return len(missing)


async def _create(
    bus: Bus,
    subjects: Subjects,
    stream: str,
    cluster: str,
    node: str,
    found: ConsumerConfig | None,
    done: Clusters,
) -> None:
    """Create ``node``'s consumer (deleting first the one ``found`` configured otherwise)."""
    config = wanted(subjects, cluster, node)
    if found is not None:
        log.warning(
            "command consumer configured otherwise; creating it again",
            extra={"consumer": config.name, "deliver_subject": found.deliver_subject or ""},
        )
        await bus.js.delete_consumer(stream, config.name or "")
    await bus.js.add_consumer(stream, config=config)
    done[node] = cluster


async def _configs(
    js: JetStreamContext, subjects: Subjects, stream: str, nodes: Mapping[str, str]
) -> dict[str, ConsumerConfig | None]:
    """Every consumer of ``stream`` by name, with its configuration where it is one of
    ``nodes``' configured otherwise than :func:`wanted` (None for the rest: nothing to
    put right). Each page is judged as it comes: a configuration decoded is about a
    kilobyte, 100 MB for every consumer of a 100,000-node fleet held at once."""
    found: dict[str, ConsumerConfig | None] = {}
    while page := await js.consumers_info(stream, offset=len(found) or None):
        for info in page:
            node = named(info.name, nodes)
            wrong = node is not None and _differs(info.config, wanted(subjects, nodes[node], node))
            found[info.name] = info.config if wrong else None
        if len(page) < INFO_PAGE:
            break
    return found


async def _names(bus: Bus, stream: str) -> dict[str, ConsumerConfig | None]:
    """Every consumer of ``stream`` by name (configurations not read: None)."""
    found: dict[str, ConsumerConfig | None] = {}
    subject = f"{bus.js_api_prefix}.CONSUMER.NAMES.{stream}"
    while True:
        asked = json.dumps({"offset": len(found)}).encode()
        answer = json.loads((await bus.request(subject, asked, timeout=API_TIMEOUT)).data)
        if "error" in answer:
            raise nats.js.errors.APIError.from_error(answer["error"])
        names = answer.get("consumers") or []
        found.update((name, None) for name in names)
        if not names or len(found) >= answer.get("total", 0):
            return found


async def ensure_each(
    bus: Bus,
    subjects: Subjects,
    nodes: Mapping[str, str],
    done: Clusters | None = None,
) -> int:
    """:func:`ensure` for the few nodes (node -> cluster) new since the last round,
    listing nothing and asking nothing first: each node's consumer is created as
    :func:`wanted` says, :data:`CREATE_BATCH` requests in flight at once (see
    :func:`_create_or_replace`). One look and one create per node, one node after the
    other, cost the aggregator 2.5 times the CPU a consumer and the server 1.5 times
    (what a fresh fleet's first minute pays for each node: docs/performance.md). How many
    creates were sent."""
    stream = subjects.stream_name(STREAM_COMMANDS)
    done = {} if done is None else done
    todo = list(nodes)
    for start in range(0, len(todo), CREATE_BATCH):
        batch = todo[start : start + CREATE_BATCH]
        await asyncio.gather(
            *(_create_or_replace(bus, subjects, stream, nodes[n], n, done) for n in batch)
        )
    return len(todo)


async def _create_or_replace(
    bus: Bus, subjects: Subjects, stream: str, cluster: str, node: str, done: Clusters
) -> None:
    """Put ``node``'s consumer in place with one create: JetStream takes a create of a
    consumer already there with the same configuration as done (nothing changes), and
    updates one configured otherwise in the fields it may (its messages and acks kept).
    The configuration it answers with is checked; one still otherwise, or a create
    refused (a push consumer cannot become a pull one: 10012), is looked up, deleted and
    created again (:func:`_create`)."""
    config = wanted(subjects, cluster, node)
    try:
        info = await bus.js.add_consumer(stream, config=config, timeout=API_TIMEOUT)
    except (nats.js.errors.ServerError, nats.js.errors.BadRequestError) as refused:
        try:
            found = await bus.js.consumer_info(stream, config.name or "", timeout=API_TIMEOUT)
        except nats.js.errors.NotFoundError:
            raise refused from None  # refused for another reason than its configuration
        if _differs(found.config, config):
            await _create(bus, subjects, stream, cluster, node, found.config, done)
        else:
            done[node] = cluster
        return
    if _differs(info.config, config):
        await _create(bus, subjects, stream, cluster, node, info.config, done)
        return
    done[node] = cluster


class Deleted:
    """The names of the consumers of FLEET_CMD the server says were deleted (its
    ``CONSUMER.DELETED`` advisories), kept until the next round takes them; at most
    :data:`DELETED_KEPT`, past which the round checks every node again."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.overflowed = False

    async def on_advisory(self, msg: Msg) -> None:
        if len(self.names) >= DELETED_KEPT:
            self.overflowed = True
            return
        self.names.add(msg.subject.rsplit(".", 1)[-1])

    def take(self) -> set[str] | None:
        """The names deleted since the last call; None when more came than were kept."""
        names, overflowed = self.names, self.overflowed
        self.names, self.overflowed = set(), False
        return None if overflowed else names


async def keep_forever(
    bus: Bus,
    subjects: Subjects,
    admitted: AdmittedNodes,
    every: float,
    full_every: float = LISTED_EVERY,
) -> None:
    """Until cancelled: every ``every`` seconds, :func:`ensure` the consumers of the
    nodes that changed since the last round: those ``admitted`` says were written (newly
    admitted, approved, revoked) and those whose consumer the server said was deleted;
    every node when ``admitted`` cannot say (a partition gained or lost). The first round
    lists every consumer with its configuration; later ones ask per node
    (:func:`ensure_each`), or list the names when more than :data:`INFO_PAGE` changed at
    once. The names are listed for every node again at the first round after the
    connection was regained (a deletion whose advisory was sent meanwhile is put back
    then) and every ``full_every`` seconds. A failed round is logged and its nodes tried
    again at the next."""
    stream = subjects.stream_name(STREAM_COMMANDS)
    deleted = Deleted()
    advisories = await bus.subscribe(f"{CONSUMER_DELETED}.{stream}.*", deleted.on_advisory)
    try:
        await _keep(bus, subjects, admitted, every, full_every, deleted)
    finally:
        await unsubscribe_quietly(advisories)


class Keeper:
    """What the keeper knows between rounds, and what a round is to check."""

    def __init__(self, admitted: AdmittedNodes) -> None:
        self.admitted = admitted
        self.ensured: Clusters = {}
        """The nodes whose consumer is known to be in place, with the cluster it was put
        in place for, not the consumer's name (a string a node, about 160 bytes with its
        entry: 16 MB at 100,000 nodes); a deleted consumer's name is matched by
        :func:`named`. A round puts each node in as its consumer is found or made. The
        nodes whose consumer should exist are asked of ``admitted``, not kept here too
        (a second dict of every node: 5 MB)."""
        self.todo: Clusters = {}
        """Nodes to check at the next round (kept through a round that failed)."""

    async def everything(self, full: bool) -> None:
        """Take every admitted node again; each is checked if ``full``, else those whose
        consumer is not known to be in place. In turns of :data:`NODES_PER_TURN`, the
        event loop running between (a pass over 100,000 nodes held it for 1 to 2 s)."""
        ensured: Clusters = {}
        todo: Clusters = {}
        for step, (cluster, node) in enumerate(self.admitted.every(), 1):
            known = self.ensured.get(node) == cluster
            if known:
                ensured[node] = cluster
            if full or not known:
                todo[node] = cluster
            await take_turn(step, NODES_PER_TURN)
        self.ensured, self.todo = ensured, todo

    def written(self, nodes: Iterable[str]) -> None:
        """Nodes whose records were written: each admitted one is checked unless its
        consumer is known to be in place; one no longer admitted is forgotten."""
        for node in nodes:
            cluster = self.admitted.cluster(node)
            if self.ensured.get(node) != cluster:
                self.ensured.pop(node, None)
                if cluster is not None:
                    self.todo[node] = cluster

    async def deleted(self, names: set[str] | None) -> None:
        """Consumers the server said were deleted (None: more than were kept, so every
        node): each still wanted is put back."""
        if names is None:
            self.ensured.clear()
            await self.everything(full=False)
            return
        for name in names:
            node = named(name, self.ensured)
            if node is None:
                continue
            del self.ensured[node]
            cluster = self.admitted.cluster(node)
            if cluster is not None and command_consumer(cluster, node) == name:
                self.todo[node] = cluster

    def done(self) -> None:
        """After a round: the nodes whose consumer it put in place (now in ``ensured``)
        are no longer to do."""
        # A new dict, not deletions: a dict keeps the table it grew to (5 MB after a first
        # round of 100,000 nodes) however few it holds after.
        ensured = self.ensured
        self.todo = {
            node: cluster for node, cluster in self.todo.items() if ensured.get(node) != cluster
        }


def named(name: str, clusters: Mapping[str, str]) -> str | None:
    """The node of ``clusters`` (node -> cluster) whose consumer is called ``name``, if
    any: ``cmd_<cluster>_<node>`` split at each ``_`` in turn (a cluster or node id may
    hold one), the split kept only where ``clusters`` says that cluster for that node,
    so a name the server sends matches no node but its own (and no name is made and
    kept per node to look it up)."""
    prefix = "cmd_"
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    cut = rest.find("_")
    while cut > 0:
        cluster, node = rest[:cut], rest[cut + 1 :]
        if clusters.get(node) == cluster and command_consumer(cluster, node) == name:
            return node
        cut = rest.find("_", cut + 1)
    return None


async def _keep(
    bus: Bus,
    subjects: Subjects,
    admitted: AdmittedNodes,
    every: float,
    full_every: float,
    deleted: Deleted,
) -> None:
    keeper = Keeper(admitted)
    configs_checked = False
    last_full = time.monotonic()
    listed_after = bus.reconnected_at
    while True:
        stop_if_cancelled()
        now = time.monotonic()
        regained = bus.reconnected_at
        full = now - last_full >= full_every or regained != listed_after
        changed = admitted.changed()
        if changed is None or full or not configs_checked:
            await keeper.everything(full)
        else:
            keeper.written(changed)
        await keeper.deleted(deleted.take())
        if await _check(bus, subjects, keeper, full or not configs_checked, configs_checked):
            configs_checked = True
            if full:
                last_full, listed_after = now, regained
        await _next_round(admitted.written, every)


async def _check(
    bus: Bus, subjects: Subjects, keeper: Keeper, listing: bool, configs_checked: bool
) -> bool:
    """One round's check of ``keeper.todo``, each node put in ``keeper.ensured`` as its
    consumer is found or made (no copy of the nodes to do, nor a set of those done: the
    first round holds every node); False if it failed (logged; the nodes not done stay
    to do)."""
    todo = keeper.todo
    if not todo:  # nothing to check: no configuration to list either
        return True
    done = keeper.ensured
    try:
        created = await (
            ensure(bus, subjects, todo, check_configs=not configs_checked, done=done)
            if listing or len(todo) > INFO_PAGE
            else ensure_each(bus, subjects, todo, done)
        )
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("command consumers not checked", extra={"reason": str(exc)})
        return False
    else:
        if created:
            log.info("command consumers put in place", extra={"consumers": created})
        return True
    finally:
        keeper.done()


async def _next_round(written: asyncio.Event, every: float) -> None:
    """Wait ``every`` seconds, or less once a record is written, though never less than
    :data:`ROUND_GAP`: a fleet writing records all the time (checkpoints) makes a few
    short rounds a second, each of the nodes written since the last."""
    await asyncio.sleep(min(ROUND_GAP, every))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(0.0, every - ROUND_GAP)):
            await written.wait()
    written.clear()  # before the round asks what changed: a later write sets it again

"""The aggregator's command-consumer keeper checks what changed, never every consumer a round."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import nats.js.errors
from nats.aio.msg import Msg

from actors.fleet.aggregator import command_queues
from actors.fleet.storage import streams
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import STREAM_COMMANDS, Subjects, command_consumer
from tests.support.fleet import wait_for
from tests.support.relay import Relay

Node = tuple[str, str]


def clusters(*nodes: Node) -> dict[str, str]:
    """Node -> cluster of (cluster, node) pairs: what the keeper's rounds hold."""
    return {node: cluster for cluster, node in nodes}


class Nodes:
    """The admitted nodes a keeper is given, told as an aggregator tells them (the
    nodes changed since it last asked), how many rounds have asked and how often the
    keeper took every node."""

    def __init__(self, *nodes: Node) -> None:
        self.nodes = list(nodes)
        self.rounds = 0
        self.walks = 0
        self._told = set(nodes)
        self.written = asyncio.Event()

    def admit(self, node: Node) -> None:
        """``node`` admitted, its record written (as the aggregator tells it)."""
        self.nodes.append(node)
        self.written.set()

    def every(self) -> list[Node]:
        self.walks += 1
        return list(self.nodes)

    def cluster(self, node: str) -> str | None:
        return next((cluster for cluster, name in self.nodes if name == node), None)

    def changed(self) -> set[str]:
        self.rounds += 1
        now = set(self.nodes)
        changed = {node for _, node in now ^ self._told}
        self._told = now
        return changed


@asynccontextmanager
async def api_requests(bus: NatsBus, prefix: str) -> AsyncIterator[list[str]]:
    """Every consumer API request about FLEET_CMD the server is sent meanwhile (by
    subject), seen by a plain subscriber beside the server's own."""
    seen: list[str] = []
    stream = Subjects(prefix).stream_name(STREAM_COMMANDS)

    async def note(msg: Msg) -> None:
        if msg.subject.split(".")[4:5] == [stream]:
            seen.append(msg.subject)

    subscription = await bus.subscribe("$JS.API.CONSUMER.>", note)
    await bus.flush()
    try:
        yield seen
    finally:
        await subscription.unsubscribe()


@asynccontextmanager
async def keeping(
    bus: NatsBus, prefix: str, admitted: command_queues.AdmittedNodes, every: float = 0.02
) -> AsyncIterator[None]:
    """:func:`command_queues.keep_forever` running every ``every`` seconds (20 ms), its
    full check never due."""
    task = asyncio.create_task(
        command_queues.keep_forever(bus, Subjects(prefix), admitted, every, 1e6)
    )
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def exists(bus: NatsBus, prefix: str, node: Node) -> bool:
    stream = Subjects(prefix).stream_name(STREAM_COMMANDS)
    try:
        await bus.js.consumer_info(stream, command_consumer(*node))
    except nats.js.errors.NotFoundError:
        return False
    return True


async def has_consumers(bus: NatsBus, prefix: str, count: int) -> bool:
    """Whether FLEET_CMD has ``count`` consumers, asked without a consumer API request
    (which :func:`api_requests` would see)."""
    info = await bus.js.stream_info(Subjects(prefix).stream_name(STREAM_COMMANDS))
    return info.state.consumer_count == count


def listings(seen: list[str]) -> list[str]:
    return [s for s in seen if ".CONSUMER.LIST." in s or ".CONSUMER.NAMES." in s]


async def test_quiet_rounds_ask_the_server_nothing(bus: NatsBus, prefix: str) -> None:
    """Once a node's consumer is made, rounds with nothing changed send no consumer
    request at all and never take every node again; a node admitted later costs one
    create, no listing and no look first."""
    admitted = Nodes(("c1", "n1"))
    async with api_requests(bus, prefix) as seen, keeping(bus, prefix, admitted):
        await wait_for(lambda: has_consumers(bus, prefix, 1))
        await wait_for(lambda: admitted.rounds >= 3)
        seen.clear()
        rounds = admitted.rounds
        await wait_for(lambda: admitted.rounds >= rounds + 10)
        assert seen == []
        admitted.admit(("c1", "n2"))
        await wait_for(lambda: has_consumers(bus, prefix, 2))
        await wait_for(lambda: admitted.rounds >= rounds + 15)
    assert listings(seen) == []
    assert [s.split(".")[3] for s in seen] == ["CREATE"]
    assert admitted.walks == 1
    assert await exists(bus, prefix, ("c1", "n2"))


async def test_with_no_node_to_keep_a_round_takes_no_node_again(bus: NatsBus, prefix: str) -> None:
    """With no admitted node (every one pending), rounds after the first never take every
    node again; a node admitted later still gets its consumer."""
    admitted = Nodes()
    async with keeping(bus, prefix, admitted):
        await wait_for(lambda: admitted.rounds >= 10)
        assert admitted.walks == 1
        admitted.admit(("c1", "n1"))
        await wait_for(lambda: exists(bus, prefix, ("c1", "n1")))
    assert admitted.walks == 1


async def test_a_node_admitted_gets_its_consumer_without_waiting_a_round(
    bus: NatsBus, prefix: str
) -> None:
    """Rounds every 10 minutes: a node admitted (its record written) gets its consumer at
    once, so it takes commands at once, not one round later."""
    admitted = Nodes(("c1", "n1"))
    async with keeping(bus, prefix, admitted, every=600.0):
        await wait_for(lambda: exists(bus, prefix, ("c1", "n1")))
        admitted.admit(("c1", "n2"))
        written = time.monotonic()
        await wait_for(lambda: exists(bus, prefix, ("c1", "n2")), timeout=60.0)
        took = time.monotonic() - written
    assert took < 10.0, f"the consumer came {took:.1f}s after the node was admitted"


async def test_a_deleted_consumer_is_put_back_from_the_advisory(bus: NatsBus, prefix: str) -> None:
    """A node's consumer deleted by hand is created again within a few rounds, told by
    the server's advisory, without a listing of every consumer (the full check is never
    due here); a node no longer admitted is not put back."""
    admitted = Nodes(("c1", "n1"), ("c1", "n2"))
    stream = Subjects(prefix).stream_name(STREAM_COMMANDS)
    async with keeping(bus, prefix, admitted):
        await wait_for(lambda: exists(bus, prefix, ("c1", "n2")))
        await wait_for(lambda: exists(bus, prefix, ("c1", "n1")))
        async with api_requests(bus, prefix) as seen:
            await bus.js.delete_consumer(stream, command_consumer("c1", "n1"))
            await wait_for(lambda: exists(bus, prefix, ("c1", "n1")))
        assert listings(seen) == []
        admitted.nodes.remove(("c1", "n2"))
        rounds = admitted.rounds
        await bus.js.delete_consumer(stream, command_consumer("c1", "n2"))
        await wait_for(lambda: admitted.rounds >= rounds + 10)
        assert not await exists(bus, prefix, ("c1", "n2"))


async def test_a_deletion_while_the_connection_was_down_is_put_back_once_regained(
    bus: NatsBus, nats_server: NatsServer, prefix: str
) -> None:
    """The keeper's connection cut (through a relay): a consumer deleted meanwhile sends
    its advisory to nobody, and the keeper's first round once the connection is back
    lists every consumer's name and puts it back (the timed full check is never due);
    no listing before the cut."""
    admitted = Nodes(("c1", "n1"))
    stream = Subjects(prefix).stream_name(STREAM_COMMANDS)
    relay = Relay(nats_server.url)
    keeper_bus = await NatsBus.connect(await relay.start(), "keeper")
    try:
        async with api_requests(bus, prefix) as seen, keeping(keeper_bus, prefix, admitted):
            await wait_for(lambda: exists(bus, prefix, ("c1", "n1")))
            await wait_for(lambda: admitted.rounds >= 3)
            assert listings(seen) == ["$JS.API.CONSUMER.LIST." + stream]
            await relay.sever()
            await wait_for(lambda: not keeper_bus.connected)
            await bus.js.delete_consumer(stream, command_consumer("c1", "n1"))
            await relay.heal()
            await wait_for(lambda: exists(bus, prefix, ("c1", "n1")), timeout=30.0)
        assert listings(seen)[1:] == ["$JS.API.CONSUMER.NAMES." + stream]
    finally:
        await keeper_bus.close()
        await relay.close()


async def test_a_new_nodes_consumer_configured_otherwise_is_put_right(
    bus: NatsBus, prefix: str
) -> None:
    """A node told new whose consumer is there configured otherwise gets the pinned
    configuration from the one create: changed in place where JetStream may (max_deliver:
    the command waiting in it kept), deleted and made again where it may not (a push
    consumer); one already right is left as it was."""
    subjects = Subjects(prefix)
    stream = subjects.stream_name(STREAM_COMMANDS)
    edited, push, right = ("c1", "edited"), ("c1", "push"), ("c1", "right")
    await bus.js.add_consumer(
        stream, config=command_queues.wanted(subjects, *edited).evolve(max_deliver=99)
    )
    await bus.js.publish(subjects.command(*edited), b"{}")
    own = command_consumer(*push)
    await bus.js.add_consumer(
        stream,
        name=own,
        durable_name=own,
        filter_subject=subjects.command(*push),
        deliver_subject=subjects.register(),
    )
    before = await bus.js.add_consumer(stream, config=command_queues.wanted(subjects, *right))
    done: dict[str, str] = {}
    todo = clusters(edited, push, right)
    assert await command_queues.ensure_each(bus, subjects, todo, done) == 3
    assert done == todo
    for node in (edited, push, right):
        config = (await bus.js.consumer_info(stream, command_consumer(*node))).config
        pinned = command_queues.wanted(subjects, *node)
        assert [getattr(config, name) for name in command_queues.PINNED] == [
            getattr(pinned, name) for name in command_queues.PINNED
        ]
    assert (await bus.js.consumer_info(stream, command_consumer(*edited))).num_pending == 1
    after = await bus.js.consumer_info(stream, command_consumer(*right))
    assert after.created == before.created


async def test_many_new_nodes_are_checked_against_one_listing(bus: NatsBus, prefix: str) -> None:
    """More nodes new at once than a listing's page (300 > 256) are checked against a
    listing of names, not one info each, and every one gets its consumer."""
    admitted = Nodes(("c1", "n0"))
    async with api_requests(bus, prefix) as seen, keeping(bus, prefix, admitted):
        await wait_for(lambda: has_consumers(bus, prefix, 1))
        admitted.nodes += [("c1", f"n{i}") for i in range(1, 301)]
        await wait_for(lambda: has_consumers(bus, prefix, 301), timeout=60)
    kinds = [subject.split(".")[3] for subject in seen]
    assert kinds.count("CREATE") == 301
    assert "INFO" not in kinds
    assert kinds.count("NAMES") >= 1


async def test_more_nodes_than_the_servers_default_consumer_limit_get_a_consumer(
    bus: NatsBus, prefix: str
) -> None:
    """FLEET_CMD takes a consumer for each of 1,001 nodes: nats-server 2.15 limits a
    stream that sets no limit to 1,000 consumers, so the stream sets its own."""
    subjects = Subjects(prefix)
    info = await bus.js.stream_info(subjects.stream_name(STREAM_COMMANDS))
    assert (info.config.max_consumers or 0) >= streams.MAX_NODES
    nodes = [("c1", f"n{i}") for i in range(1001)]
    created = await command_queues.ensure(bus, subjects, clusters(*nodes), check_configs=False)
    assert created == 1001
    assert await has_consumers(bus, prefix, 1001)


async def test_a_walk_over_every_node_lets_the_loop_run_between_turns() -> None:
    """Taking every admitted node again (a partition gained, the full check) takes at most
    NODES_PER_TURN nodes a round of the event loop, and still takes every node: at
    100,000 nodes the walk held the aggregator's loop for 1 to 2 s, its lease renewals
    with it."""
    count = 2 * command_queues.NODES_PER_TURN + 10
    nodes = Nodes(*((f"c{i % 3}", f"n{i}") for i in range(count)))
    rounds = 0
    taken_in: dict[int, int] = {}

    def every() -> Iterator[Node]:
        for node in nodes.nodes:
            taken_in[rounds] = taken_in.get(rounds, 0) + 1
            yield node

    async def tick() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await asyncio.sleep(0)

    nodes.every = every  # type: ignore[assignment, method-assign]
    keeper = command_queues.Keeper(nodes)
    ticker = asyncio.create_task(tick())
    try:
        await keeper.everything(full=True)
    finally:
        ticker.cancel()
    assert max(taken_in.values()) <= command_queues.NODES_PER_TURN
    assert len(taken_in) >= 3
    assert keeper.todo == clusters(*nodes.nodes)
    assert keeper.ensured == {}


async def test_a_deleted_consumers_name_finds_its_node_with_underscores_in_ids() -> None:
    """The keeper keeps node -> cluster, not consumer names: a deleted consumer's name
    (``cmd_<cluster>_<node>``) is matched to its node however many ``_`` the cluster and
    node id hold, a name of no node kept (or of its node's former cluster) checks
    nothing, and too many deletions to keep check every admitted node."""
    kept = [("east_1", "gpu_node_7"), ("east", "1_gpu"), ("west", "n1")]
    nodes = Nodes(*kept)
    keeper = command_queues.Keeper(nodes)
    await keeper.everything(full=True)
    keeper.ensured.update(clusters(*kept))  # as a round puts each in place
    keeper.done()
    assert keeper.todo == {}
    assert keeper.ensured == {node: cluster for cluster, node in kept}
    await keeper.deleted({command_consumer("east_1", "gpu_node_7"), "cmd_nowhere_n9", "other"})
    assert keeper.todo == {"gpu_node_7": "east_1"}
    assert "gpu_node_7" not in keeper.ensured
    await keeper.deleted({command_consumer("east", "n1")})  # n1 is in west
    assert keeper.todo == {"gpu_node_7": "east_1"}
    assert keeper.ensured == {"1_gpu": "east", "n1": "west"}
    await keeper.deleted(None)  # more deletions than kept: every admitted node again
    assert keeper.todo == clusters(*kept) and keeper.ensured == {}


async def test_the_first_listing_puts_right_only_the_consumers_configured_otherwise(
    bus: NatsBus, prefix: str
) -> None:
    """The first round's listing (configurations judged page by page, only the wrong ones
    kept) makes again the consumers of the nodes given that are configured otherwise, a
    node's consumer with an underscore in its ids included, and leaves alone one that is
    right and one of a node not given."""
    subjects = Subjects(prefix)
    stream = subjects.stream_name(STREAM_COMMANDS)
    edited, right, other = ("c_1", "edited_1"), ("c1", "right"), ("c1", "other")
    for node in (edited, other):
        await bus.js.add_consumer(
            stream, config=command_queues.wanted(subjects, *node).evolve(max_deliver=99)
        )
    before = await bus.js.add_consumer(stream, config=command_queues.wanted(subjects, *right))
    done: dict[str, str] = {}
    created = await command_queues.ensure(
        bus, subjects, clusters(edited, right), check_configs=True, done=done
    )
    assert created == 1
    assert done == clusters(edited, right)
    fixed = (await bus.js.consumer_info(stream, command_consumer(*edited))).config
    assert fixed.max_deliver == command_queues.wanted(subjects, *edited).max_deliver != 99
    assert (await bus.js.consumer_info(stream, command_consumer(*right))).created == before.created
    assert (await bus.js.consumer_info(stream, command_consumer(*other))).config.max_deliver == 99

"""The actor skeleton written once (``listening`` subscribes before ready, and
unsubscribes), and a connection that leaves a frozen or quorum-less server."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from actors.runtime import bus as bus_module
from actors.runtime.bus import PING_INTERVAL, PINGS_MISSED, Handler, NatsBus
from actors.runtime.embedded import NatsServer
from actors.runtime.subscriptions import listening
from schemas.subjects import EVENT_SAMPLE, EVENT_STATE, Subjects
from tests.support.fleet import wait_for


@pytest.fixture
async def publisher(nats_server: NatsServer) -> AsyncIterator[NatsBus]:
    """A second connection, so what it sees depends only on what the server knows."""
    connected = await NatsBus.connect(nats_server.url, "publisher")
    yield connected
    await connected.close()


async def assert_no_subscriber(bus: NatsBus, publisher: NatsBus, subject: str) -> None:
    await bus.flush()  # our UNSUB reaches the server before the other connection asks
    with pytest.raises(nats.errors.NoRespondersError):
        await publisher.request(subject, b"{}", timeout=2.0)


async def test_listening_subscribes_before_ready_and_unsubscribes_after(
    bus: NatsBus, publisher: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every route is subscribed and flushed before ready(), so messages another
    connection publishes at that moment reach their handler; once the block is left,
    the subjects have no subscriber."""
    subjects = [
        Subjects(prefix).event("n1", EVENT_SAMPLE),
        Subjects(prefix).event("n1", EVENT_STATE),
    ]
    received: asyncio.Queue[str] = asyncio.Queue()
    publishing: list[asyncio.Task[None]] = []

    async def handler(msg: Msg) -> None:
        await received.put(msg.subject)

    order: list[str] = []
    subscribe, flush = bus.subscribe, bus.flush

    async def recording_subscribe(subject: str, handler: Handler, queue: str = "") -> Subscription:
        order.append("subscribe")
        return await subscribe(subject, handler, queue)

    async def recording_flush(timeout: float = 2.0) -> None:
        await flush(timeout)
        order.append("flush")

    monkeypatch.setattr(bus, "subscribe", recording_subscribe)
    monkeypatch.setattr(bus, "flush", recording_flush)

    def ready() -> None:
        order.append("ready")
        publishing.extend(
            asyncio.create_task(publisher.publish(subject, b"{}")) for subject in subjects
        )

    async with listening(bus, dict.fromkeys(subjects, handler), ready):
        await asyncio.gather(*publishing)
        await publisher.flush()
        got = {await asyncio.wait_for(received.get(), 2.0) for _ in subjects}
        assert got == set(subjects)
    assert order == ["subscribe", "subscribe", "flush", "ready"]
    for subject in subjects:
        await assert_no_subscriber(bus, publisher, subject)


async def test_listening_without_ready_still_unsubscribes_on_failure(
    bus: NatsBus, publisher: NatsBus, prefix: str
) -> None:
    """Without a ready callback nothing is called; a body that raises still unsubscribes."""
    subject = Subjects(prefix).event("n1", EVENT_SAMPLE)
    received: asyncio.Queue[str] = asyncio.Queue()

    async def handler(msg: Msg) -> None:
        await received.put(msg.subject)

    with pytest.raises(RuntimeError, match="boom"):
        async with listening(bus, {subject: handler}):
            await publisher.publish(subject, b"{}")
            assert await asyncio.wait_for(received.get(), 2.0) == subject
            raise RuntimeError("boom")
    await assert_no_subscriber(bus, publisher, subject)


async def test_flush_returns_only_after_the_server_has_every_earlier_subscription(
    bus: NatsBus, publisher: NatsBus, prefix: str
) -> None:
    """nats-py writes flush()'s PING ahead of a SUB still in its buffer; the server may
    then answer before it knows the subscription. Repeated rounds of subscribe, flush,
    publish from another connection must each deliver (without the fix, about one round
    in thirty lost its message on this machine)."""
    received: asyncio.Queue[str] = asyncio.Queue()

    async def handler(msg: Msg) -> None:
        await received.put(msg.subject)

    for round_number in range(300):
        subject = f"{prefix}.flush.{round_number}"
        subscription = await bus.subscribe(subject, handler)
        await bus.flush()
        await publisher.publish(subject, b"{}")
        await publisher.flush()
        assert await asyncio.wait_for(received.get(), 2.0) == subject
        await subscription.unsubscribe()


async def test_a_cancelled_flush_leaves_the_connection_reading(bus: NatsBus) -> None:
    """Flushes cancelled while their PING is out (an actor stopping mid-flush) leave the
    connection's reader running: a later request is still answered and rtt still works."""
    loop = asyncio.get_running_loop()
    for _ in range(20):
        flush = asyncio.create_task(bus.flush())
        for _ in range(1000):  # until its PING is out (its PONG not read yet)
            if bus.nc._pongs:
                break
            await asyncio.sleep(0)
        # No PING goes out once the reader is gone (nats-py then only writes pending data).
        assert bus.nc._pongs, "no PING in flight: the connection's reader has died"
        flush.cancel()
        await asyncio.gather(flush, return_exceptions=True)
    await wait_for(lambda: not bus.nc._pongs)  # every PONG of the cancelled flushes is back
    assert bus.nc._reading_task is not None and not bus.nc._reading_task.done()

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    subscription = await bus.subscribe("t.echo", echo)
    try:
        await bus.flush()
        reply = await bus.request("t.echo", b"ping", timeout=2)
        assert reply.data == b"ping"
        start = loop.time()
        assert 0 < await bus.rtt() < loop.time() - start + 1e-3
    finally:
        await subscription.unsubscribe()


def unclustered(tmp_path: Path, names: tuple[str, ...]) -> Iterator[list[NatsServer]]:
    """Servers that know nothing of each other (no cluster: nothing is discovered), each
    left running (and resumed, if paused) until the test ends."""
    servers = [NatsServer(tmp_path / name, name=name).start() for name in names]
    yield servers
    for server in servers:
        if server.process is not None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def two_servers(tmp_path: Path) -> Iterator[list[NatsServer]]:
    """Two unclustered servers."""
    yield from unclustered(tmp_path, ("s1", "s2"))


@pytest.fixture
def three_servers(tmp_path: Path) -> Iterator[list[NatsServer]]:
    """Three unclustered servers."""
    yield from unclustered(tmp_path, ("s1", "s2", "s3"))


def serving(bus: NatsBus, servers: list[NatsServer]) -> NatsServer:
    """The server ``bus`` is connected to."""
    url = bus.nc.connected_url
    assert url is not None
    return next(server for server in servers if server.port == url.port)


async def test_a_frozen_server_is_left_for_another_within_seconds(
    two_servers: list[NatsServer],
) -> None:
    """A server that stops answering (SIGSTOP: its socket stays open) is left for the other
    one of the list once PINGS_MISSED PINGs in a row go unanswered, within seconds, not
    nats-py's 2 minutes x 2 (and then the 30 s asyncio waits for a frozen peer's TLS
    goodbye)."""
    bus = await NatsBus.connect(",".join(s.url for s in two_servers), "moving")
    try:
        frozen = serving(bus, two_servers)
        assert frozen.process is not None
        os.kill(frozen.process.pid, signal.SIGSTOP)
        bound = PINGS_MISSED * 2 * PING_INTERVAL + 5.0
        await wait_for(lambda: bus.connected and serving(bus, two_servers) is not frozen, bound)
        await bus.flush()
    finally:
        await bus.close()


# nats-py drops its socket to a server whose handshake timed out without closing it:
# the writer's destructor closes it (CPython frees it at once) and warns.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function StreamWriter.__del__"
    ":pytest.PytestUnraisableExceptionWarning"
)
async def test_a_reconnect_waits_on_a_frozen_server_for_one_handshake_step(
    three_servers: list[NatsServer],
) -> None:
    """Leaving a server for the next of the list, which is frozen (SIGSTOP: it accepts
    the TCP connection and never sends its INFO), the connection moves on to the third
    after SERVER_TIMEOUT, not after the whole connect_timeout (5 s): a fault round's
    node sat on a paused server for 4.8 s and was called stale."""
    bus = await NatsBus.connect(",".join(s.url for s in three_servers), "moving")
    try:
        left = serving(bus, three_servers)
        following = bus.nc._server_pool[0].uri.port  # nats-py's next on a reconnect
        [frozen] = [server for server in three_servers if server.port == following]
        assert frozen is not left and frozen.process is not None
        os.kill(frozen.process.pid, signal.SIGSTOP)
        start = time.monotonic()
        bus._leave("test")
        await wait_for(lambda: bus.connected and serving(bus, three_servers) not in (left, frozen))
        took = time.monotonic() - start
        print(f"reconnected past the frozen server in {took:.2f}s")
        assert bus_module.SERVER_TIMEOUT <= took < 4.0, took
    finally:
        await bus.close()


FAKE_INFO = b'INFO {"server_id":"fake","version":"2.10.0","proto":1,"headers":true}\r\n'
"""What a NATS server says first; enough for nats-py to connect."""


async def test_leaving_a_server_drops_the_bytes_it_was_not_yet_sent() -> None:
    """Leaving a server resets the connection: the bytes the kernel still held for it (a
    server cut off, or not reading) are dropped, not sent on after the connection was left.
    A plain close went on sending them for as long as TCP retries, and a fault round's
    isolated node had its heartbeat from before the cut stored after its newer ones, sent
    through another server meanwhile: a replay alert. The server here takes the handshake,
    then reads nothing until the connection is left; what it reads then ends in a reset,
    not in every byte published and an orderly end."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    # A small window: the client's kernel keeps what the server's has no room for.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)

    handshaken: asyncio.Future[socket.socket] = loop.create_future()
    talks: list[asyncio.Task[None]] = []
    connections: list[socket.socket] = []

    async def handshake(connection: socket.socket) -> None:
        await loop.sock_sendall(connection, FAKE_INFO)
        said = b""
        while b"PING\r\n" not in said:
            heard = await loop.sock_recv(connection, 4096)
            if not heard:  # the connect's look at what answers there, done
                return
            said += heard
        await loop.sock_sendall(connection, b"PONG\r\n")
        if not handshaken.done():  # the first connection, not a reconnect
            handshaken.set_result(connection)

    async def serve() -> None:
        while True:
            connection, _ = await loop.sock_accept(listener)
            connections.append(connection)
            talks.append(asyncio.create_task(handshake(connection)))

    serving = asyncio.create_task(serve())
    bus = await NatsBus.connect(f"nats://127.0.0.1:{listener.getsockname()[1]}", "leaving")
    server = await handshaken
    transport = bus.nc._transport._io_writer.transport  # type: ignore[union-attr]

    async def publish() -> None:  # held once nats-py waits for the server to read
        for _ in range(128):  # 8 MB: more than the kernel's buffers take (4 MB at most)
            await bus.publish("before.the.cut", b"x" * 65536)

    publishing = asyncio.create_task(publish())
    try:
        # asyncio holds bytes of its own once the kernel's send queue is full.
        await wait_for(lambda: transport.get_write_buffer_size() > 0)
        bus._leave("test")
        with pytest.raises(ConnectionResetError):
            while await loop.sock_recv(server, 65536):
                pass
    finally:
        for task in (publishing, serving, *talks):
            task.cancel()
        await bus.close()
        for connection in (*connections, listener):
            connection.close()


async def test_jetstream_timing_out_moves_the_connection_to_another_server(
    two_servers: list[NatsServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steady JetStream calls that go unanswered for MOVE_AFTER (at least two) move the
    connection to the next server of the list; one answered call between them resets the
    count, so failures with answers between never move it."""
    monkeypatch.setattr(bus_module, "MOVE_AFTER", 0.0)
    bus = await NatsBus.connect(",".join(s.url for s in two_servers), "moving")
    try:
        first = serving(bus, two_servers)
        bus.jetstream_answered(False)
        bus.jetstream_answered(True)
        bus.jetstream_answered(False)
        await bus.flush()
        assert serving(bus, two_servers) is first
        bus.jetstream_answered(False)
        await wait_for(lambda: bus.connected and serving(bus, two_servers) is not first)
        # The next move waits for the backoff, however many failures come meanwhile.
        bus.jetstream_answered(False)
        bus.jetstream_answered(False)
        second = serving(bus, two_servers)
        await bus.flush()
        assert serving(bus, two_servers) is second
    finally:
        await bus.close()


async def test_a_move_tries_every_server_before_backing_off(
    three_servers: list[NatsServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move that lands on a server where JetStream fails too moves on to the one not yet
    tried at once (seed 7: a node moved onto the server cut off from the cluster and sat
    there 10 s, called stale); only the move back to the first waits for the backoff, and
    an answered call starts a new round."""
    monkeypatch.setattr(bus_module, "MOVE_AFTER", 0.0)
    bus = await NatsBus.connect(",".join(s.url for s in three_servers), "moving")

    try:
        first = serving(bus, three_servers)
        second = await fail_until_moved(bus, three_servers)
        third = await fail_until_moved(bus, three_servers)
        assert {first, second, third} == set(three_servers)
        # Every server tried: going back to the first waits for the backoff.
        bus.jetstream_answered(False)
        bus.jetstream_answered(False)
        await bus.flush()
        assert serving(bus, three_servers) is third
        # An answer ends the round: the next failures move at once again.
        bus.jetstream_answered(True)
        assert await fail_until_moved(bus, three_servers) is first
    finally:
        await bus.close()


async def fail_until_moved(bus: NatsBus, servers: list[NatsServer]) -> NatsServer:
    """Two unanswered calls; the server the connection is on once it has moved."""
    left = serving(bus, servers)
    bus.jetstream_answered(False)
    bus.jetstream_answered(False)
    await wait_for(lambda: bus.connected and serving(bus, servers) is not left)
    return serving(bus, servers)


async def test_a_node_goes_round_again_within_a_quarter_of_its_stale_after(
    three_servers: list[NatsServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every server failed, the wait before going round the list again is the
    ``move_backoff`` given (an agent's: a quarter of its ``stale_after``), not 10 s: a node
    that landed on the server cut off from the cluster leaves it before it is stale."""
    monkeypatch.setattr(bus_module, "MOVE_AFTER", 0.0)
    assert bus_module.move_backoff(2.0) == 0.5
    assert bus_module.move_backoff(30.0) == 7.5
    assert bus_module.move_backoff(300.0) == bus_module.MOVE_BACKOFF_INITIAL
    urls = ",".join(s.url for s in three_servers)
    bus = await NatsBus.connect(urls, "moving", move_backoff=bus_module.move_backoff(2.0))
    try:
        for _ in three_servers[1:]:
            await fail_until_moved(bus, three_servers)
        last = serving(bus, three_servers)
        started = time.monotonic()

        async def moved_on() -> bool:
            bus.jetstream_answered(False)
            return bus.connected and serving(bus, three_servers) is not last

        await wait_for(moved_on, interval=0.05)
        waited = time.monotonic() - started
        # 0.5 s (jittered) plus nats-py's own wait before a server it left a moment ago;
        # the default backoff alone would be 10 s.
        assert waited < 5.0, f"went round again after {waited:.2f} s (backoff 0.5 s)"
    finally:
        await bus.close()


async def test_a_close_that_hangs_after_a_failed_drain_is_left_in_time(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain fails (reconnecting) and nats-py's close then never returns: ``close``
    still returns within its timeout, logging that it left the connection."""
    closing = await NatsBus.connect(nats_server.url, "test")

    async def reconnecting() -> None:
        raise nats.errors.ConnectionReconnectingError

    never = asyncio.Event()

    async def hanging() -> None:
        await never.wait()

    monkeypatch.setattr(closing.nc, "drain", reconnecting)
    real_close = closing.nc.close
    monkeypatch.setattr(closing.nc, "close", hanging)
    try:
        async with asyncio.timeout(10):
            await closing.close(timeout=0.2)
    finally:
        await real_close()

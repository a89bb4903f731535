"""The harness's clients in the hub namespace: the operator sending signed cordons and
uncordons, and the wiretap that watches the servers.

The operator sends a command every ~2 s to a random node and records, for each, whether
FLEET_CMD acknowledged it: a publish that times out is sent again under the same
``Nats-Msg-Id`` for :data:`SEND_FOR` seconds (an answer "duplicate" means the stream had it).

The wiretap holds one connection per server (that server only), so it sees what each
server sees, partitioned or not, and records: every acknowledgement of a FLEET_HB
partition consumer with the inbox its delivery went to (whose loop acked it), every
publish of an alert, and every write of a node record the stream acknowledged.
"""

from __future__ import annotations

import asyncio
import random
import ssl
import time

import msgspec
import nats.errors
from nats.aio.msg import Msg

from actors.fleet.operator.commands import new_command
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Cordon, Uncordon
from schemas.subjects import BUCKET_NODES, STREAM_HEARTBEATS, Subjects
from tests.faults.cluster import CLUSTER, PREFIX
from tests.faults.history import Ack, CommandSent, RecordWrite

SEND_FOR = 10.0
"""Seconds the operator keeps trying one command."""
TRY_TIMEOUT = 2.0
PERIOD = (1.5, 2.5)
"""Seconds between two commands, drawn uniformly."""
ACK_PREFIX = f"$JS.ACK.{STREAM_HEARTBEATS}."


class Operator:
    def __init__(
        self, bus: NatsBus, key: signing.KeyPair, nodes: list[str], rng: random.Random
    ) -> None:
        self.bus = bus
        self.key = key
        self.nodes = nodes
        self.rng = rng
        self.subjects = Subjects(PREFIX)
        self.sent: list[CommandSent] = []
        self.cordoned = dict.fromkeys(nodes, False)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            node = self.rng.choice(self.nodes)
            await self.send(node, "uncordon" if self.cordoned[node] else "cordon")
            self.cordoned[node] = not self.cordoned[node]
            try:
                async with asyncio.timeout(self.rng.uniform(*PERIOD)):
                    await stop.wait()
            except TimeoutError:
                pass

    async def send(self, node: str, action: str) -> None:
        command = new_command(
            node,
            CLUSTER,
            Cordon() if action == "cordon" else Uncordon(),
            reason="fault harness",
            expires=900.0,
        )
        body = codec.encode(command)
        headers = self.key.headers(body)
        headers["Nats-Msg-Id"] = command.id
        subject = self.subjects.command(CLUSTER, node)
        sent, error = time.time(), ""
        acked: float | None = None
        while acked is None:
            try:
                await self.bus.js.publish(subject, body, timeout=TRY_TIMEOUT, headers=headers)
                acked = time.time()
            except (nats.errors.Error, TimeoutError) as exc:
                error = str(exc) or type(exc).__name__
                if time.time() - sent > SEND_FOR:
                    break
                await asyncio.sleep(0.5)
        self.sent.append(CommandSent(command.id, node, action, sent, acked, error))


class _Record(msgspec.Struct):
    node_id: str
    state: str
    last_seq: int


class Wiretap:
    """Watches every server through a connection of its own."""

    def __init__(self) -> None:
        self.buses: list[NatsBus] = []
        self.acks: dict[str, Ack] = {}
        self.deliveries: dict[str, str] = {}
        self.alert_publishes: dict[str, float] = {}
        self.records: dict[tuple[str, int, str], RecordWrite] = {}
        self._writes: dict[str, RecordWrite] = {}
        """Record writes seen, by the reply subject their answer will come on: a write
        counts once the stream acknowledged it (a compare-and-set refused is no write)."""

    async def start(self, urls: list[str], seed: str, tls: ssl.SSLContext) -> None:
        subjects = Subjects(PREFIX)
        for url in urls:
            bus = await NatsBus.connect(url, "flt-wiretap", nkey_seed=seed, tls=tls)
            self.buses.append(bus)
            await bus.subscribe(f"{ACK_PREFIX}>", self._on_ack)
            await bus.subscribe("_INBOX.>", self._on_delivery)
            await bus.subscribe(subjects.alerts(), self._on_alert)
            await bus.subscribe(f"$KV.{subjects.bucket_name(BUCKET_NODES)}.>", self._on_record)
            await bus.flush()

    async def close(self) -> None:
        for bus in self.buses:
            await bus.close(2.0)

    async def _on_ack(self, msg: Msg) -> None:
        if msg.data not in (b"", b"+ACK"):
            return
        seen = self.acks.get(msg.subject)
        tokens = msg.subject.split(".")
        if seen is None and len(tokens) >= 9:
            owner = self.deliveries.get(msg.subject, "")
            self.acks[msg.subject] = Ack(time.time(), tokens[3], int(tokens[5]), owner)

    async def _on_delivery(self, msg: Msg) -> None:
        if msg.reply.startswith(ACK_PREFIX):
            self.deliveries.setdefault(msg.reply, msg.subject)
        write = self._writes.pop(msg.subject, None)
        if write is not None and b'"error"' not in msg.data:
            self.records.setdefault((write.node, write.last_seq, write.state), write)

    async def _on_alert(self, msg: Msg) -> None:
        msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        self.alert_publishes.setdefault(msg_id, time.time())

    async def _on_record(self, msg: Msg) -> None:
        if not msg.data:
            return
        try:
            record = msgspec.json.decode(msg.data, type=_Record)
        except msgspec.DecodeError:
            return
        write = RecordWrite(time.time(), record.node_id, record.state, record.last_seq)
        self._writes.setdefault(msg.reply, write)

    def ack_list(self) -> list[Ack]:
        """Every ack, its owner filled in from deliveries seen after it (by another tap)."""
        return sorted(
            (
                Ack(
                    ack.at,
                    ack.consumer,
                    ack.stream_seq,
                    ack.owner or self.deliveries.get(subject, ""),
                )
                for subject, ack in self.acks.items()
            ),
            key=lambda ack: ack.at,
        )

"""Aggregator actor (provider side): verifies heartbeats and keeps ``fleet_nodes`` true.

``FLEET_HB`` is split into N partitions (docs/failure-detection.md, "How partitions
work"); this aggregator consumes the partitions whose leases it holds and keeps only
those partitions' nodes. A heartbeat is accepted only if its key is the node's approved
key, its signature verifies over the received bytes, its body names the subject's node
and cluster, its timestamp is within the skew bound and its seq is above the last
accepted one. Refusals change nothing and raise an alert. The server's TTL delete marker
on a node's subject is the ``stale`` signal; a stale record older than ``offline_after``
becomes offline.

The work is done by parts with one job each, wired here; a heartbeat's way through them
reads top to bottom in :meth:`HeartbeatPath.judge`:

- :mod:`~actors.fleet.aggregator.ownership`: the partitions held, their consumers, whose a
  heartbeat is;
- :mod:`~actors.fleet.aggregator.verify`: keys and signatures, ahead of judging;
- :mod:`~actors.fleet.aggregator.judge`: the verdict, pure (no I/O);
- :mod:`~actors.fleet.aggregator.ledger`: the node table, which takes verdicts in;
  :mod:`~actors.fleet.aggregator.reads` and :mod:`~actors.fleet.aggregator.writes`:
  its records read from and written to ``fleet_nodes``;
  :mod:`~actors.fleet.aggregator.silence`: a TTL marker after a silence of the whole
  stream held, not believed at once;
- beside the path, :mod:`~actors.fleet.aggregator.sweeps` (stale, offline, refused, full) and
  :mod:`~actors.fleet.aggregator.registrar` (``fleet.register``).

No part calls back into the one that called it: each returns, and this module does the
next step (and turns the verdict's alerts and writes into I/O steps).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

import nats.js.errors
from nats.aio.msg import Msg

from actors.fleet.aggregator import command_queues, judge
from actors.fleet.aggregator.admitted import Admitted
from actors.fleet.aggregator.judge import (
    LateDelivery,
    Moment,
    NeedsFetch,
    Refused,
    Stored,
    Verdict,
)
from actors.fleet.aggregator.ledger import Ledger
from actors.fleet.aggregator.outage import GAP_KINDS
from actors.fleet.aggregator.ownership import Ownership
from actors.fleet.aggregator.reads import RecordReads
from actors.fleet.aggregator.record_rules import AlertSpec
from actors.fleet.aggregator.registrar import Registrar
from actors.fleet.aggregator.retirement import Retirement
from actors.fleet.aggregator.silence import Held
from actors.fleet.aggregator.source_watch import SourceWatch
from actors.fleet.aggregator.sweeps import Sweeps
from actors.fleet.aggregator.verify import Signatures
from actors.fleet.aggregator.view import View
from actors.fleet.aggregator.writes import RecordWrites
from actors.fleet.alerts.publisher import AlertPublisher
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.node_store import NodeStore
from actors.fleet.storage.streams import StreamLimits, provision
from actors.runtime.batch_pull import Chain, Step, delivery
from actors.runtime.bus import Bus
from actors.runtime.subscriptions import listening
from actors.runtime.supervisor import FatalError
from schemas.errors import InvalidToken
from schemas.messages import Heartbeat
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

MARKER_REASON = "Nats-Marker-Reason"
REPLICAS_NOT_SUPPORTED = 10074
"""JetStream's error code for ``replicas > 1 not supported in non-clustered mode``."""
JUDGED_PER_TURN = 32
"""Heartbeats a partition judges in one turn of the event loop (about 12 ms of CPU).
The partitions take turns (:attr:`HeartbeatPath.turn`): what else the process does
waits for one turn, never for every partition's whole fetch. With whole fetches (256
heartbeats, 8 partitions) a loop round took a second while a cold start judged a
backlog; a lease renewal needs several rounds, so the renewals missed their fence and
the aggregator let every partition go (the 100,000-node cold start that never ended)."""


class AggregatorActor:
    """Subscribes to its partitions of FLEET_HB (one durable consumer each) and
    fleet.register; publishes NodeRecord in fleet_nodes and Alert on
    fleet.alert.<kind>.<cluster>.<node>."""

    name = "aggregator"

    def __init__(
        self, config: AggregatorConfig, bus: Bus, metrics: AggregatorMetrics | None = None
    ) -> None:
        self.config = config
        self.bus = bus
        self.subjects = subjects = Subjects(config.prefix)
        self.metrics = metrics = metrics or AggregatorMetrics()
        self.alerts = AlertPublisher(bus, subjects, config.alert_window, config.alert_repeat)
        self.store = store = NodeStore(bus, subjects, metrics)
        self.ledger = ledger = Ledger(config, metrics)
        self.reads = reads = RecordReads(ledger, bus, subjects)
        self.writes = writes = RecordWrites(ledger, bus, subjects, store)
        self.ownership = Ownership(config, bus, subjects, metrics, ledger, reads, writes)
        retirement = Retirement(
            config, bus, subjects, ledger, self.ownership, writes, self.alerts, metrics
        )
        self.sweeps = Sweeps(
            config, ledger, reads, writes, self.ownership, store, self.alerts, retirement
        )
        self.source_watch = SourceWatch(bus, subjects, self.ownership.holds_first)
        self.registrar = Registrar(
            config, bus, subjects, metrics, store, ledger, self.ownership.owns
        )
        self.path = HeartbeatPath(
            config,
            metrics,
            self.alerts,
            self.ownership,
            Signatures(store, ledger.nodes),
            ledger,
            reads,
            writes,
        )
        self.admitted = Admitted(ledger.nodes, self.ownership)
        """The nodes whose command consumer it keeps, told by what changed."""
        self.view = View(ledger.nodes)
        """What the views in this process read of the nodes it holds."""

    def problem(self) -> str:
        return self.ownership.problem()

    async def handle_batch(self, messages: list[Msg]) -> list[Chain]:
        """One fetch of FLEET_HB through :class:`HeartbeatPath` (what the consume loops
        call; a test may wrap it before the actor runs)."""
        return await self.path.handle_batch(messages)

    async def run(self, ready: Callable[[], None]) -> None:
        try:
            await provision(
                self.bus.js, self.subjects, self.config.replicas, StreamLimits.of(self.config)
            )
        except nats.js.errors.APIError as exc:
            if exc.err_code != REPLICAS_NOT_SUPPORTED:
                raise
            # No restart makes a single server a cluster: say so and stop.
            raise FatalError(
                f"replicas = {self.config.replicas} needs a clustered nats-server; "
                "this one is not (use replicas = 1)"
            ) from None
        await self.ownership.prepare()
        routes = {self.subjects.register(): self.registrar.on_register}
        # Any task failing (a partition's consume loop included) ends them all and the
        # actor, so the supervisor restarts it; the leases are released on the way out.
        async with (
            listening(self.bus, routes, ready, queue="aggregators"),
            asyncio.TaskGroup() as group,
        ):
            group.create_task(self.store.follow_trust(self.reads.on_trust_change))
            group.create_task(self.ownership.run(group, self.handle_batch))
            group.create_task(self.sweeps.run())
            group.create_task(self.source_watch.run())
            group.create_task(self.writes.checkpoint_forever())
            group.create_task(self.reads.reread_forever())
            group.create_task(
                command_queues.keep_forever(
                    self.bus, self.subjects, self.admitted, self.config.sweep_interval
                )
            )


class HeartbeatPath:
    """A heartbeat's way through the parts, top to bottom: ``ownership`` says whose it
    is, ``verify`` checks its signature, :mod:`~actors.fleet.aggregator.judge` gives the verdict,
    ``ledger`` takes it in; what is left is I/O (alerts, ``writes``, fresh ``reads``), returned
    as steps for the consume loop to run."""

    def __init__(
        self,
        config: AggregatorConfig,
        metrics: AggregatorMetrics,
        alerts: AlertPublisher,
        ownership: Ownership,
        verify: Signatures,
        ledger: Ledger,
        reads: RecordReads,
        writes: RecordWrites,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.alerts = alerts
        self.ownership = ownership
        self.verify = verify
        self.ledger = ledger
        self.reads = reads
        self.writes = writes
        self._last_delivery: tuple[float, int, int] | None = None
        self.turn = asyncio.Lock()
        """Held by the partition whose turn it is to judge (:data:`JUDGED_PER_TURN`
        heartbeats, then one round of the loop); the others queue for it, first come,
        first served."""

    async def handle_batch(self, messages: list[Msg]) -> list[Chain]:
        """Judge every message of a fetch in memory, in order, in turns of
        :data:`JUDGED_PER_TURN` (each whole: nothing runs between the signatures checked
        ahead and their judging); return the I/O left to do (alerts, record writes, KV
        reads a refusal needs), one chain per node. A node with a chain has its later
        messages of the fetch judged after the chain's steps. The batch waits for the
        trust watch first (:meth:`Signatures.keys_current`)."""
        await self.verify.keys_current()
        chains: dict[str, Chain] = {}
        for start in range(0, len(messages), JUDGED_PER_TURN):
            async with self.turn:
                self._judge_turn(messages[start : start + JUDGED_PER_TURN], chains)
                # Held through one round of the loop: the rest of the process runs, the
                # other partitions wait for the turn (not ready, so not in that round).
                await asyncio.sleep(0)
        return list(chains.values())

    def _judge_turn(self, messages: list[Msg], chains: dict[str, Chain]) -> None:
        """One turn of :meth:`handle_batch`: ``messages`` judged, their I/O added to
        ``chains``."""
        self.verify.ahead(messages)
        for msg in messages:
            chain = chains.get(msg.subject)
            if chain is not None:
                chain.append((msg, partial(self.handle, msg)))
                continue
            try:
                steps = self.judge(msg)
            except Exception as exc:
                # A message that breaks the judge (never raised for bad input: a bug) is
                # terminated alone; raising here would redeliver the batch forever.
                self.metrics.dropped.labels("handler_error").inc()
                log.error(
                    "heartbeat broke its handler; terminated",
                    exc_info=True,
                    extra={"subject": msg.subject, "reason": repr(exc)},
                )
                steps = [msg.term]
            if steps:
                chains[msg.subject] = [(msg, step) for step in steps]
        self.verify.verified = {}
        self._after_judging()

    async def handle(self, msg: Msg) -> None:
        """Apply one message of FLEET_HB and do its I/O. Never raises for bad input: it
        alerts."""
        steps = self.judge(msg)
        self._after_judging()
        for step in steps:
            await step()

    def judge(self, msg: Msg, fetched: bool = False) -> list[Step]:
        """Apply one message of FLEET_HB to the in-memory state; return the I/O to do (in
        order). ``fetched``: the node's trusted key and record were just read afresh."""
        try:
            partition, cluster, node = self.ownership.split(msg.subject)
        except InvalidToken:
            self.metrics.dropped.labels("malformed_subject").inc()
            log.warning("heartbeat on a malformed subject", extra={"subject": msg.subject})
            return []
        ahead = self.verify.verified.get(id(msg))
        stream_seq, at, pending = delivery(msg) if ahead is None else ahead[1]
        stored = Stored(stream_seq=stream_seq, at=at)
        self._last_delivery = (at, pending, partition)
        headers = msg.headers or {}
        state = self.ledger.nodes.get(node)
        marker = headers.get(MARKER_REASON)
        if marker is None:
            self.ledger.pulse.stored(stored.at)
        if (
            state is None
            and not fetched
            and (marker is not None or not self.verify.known_signer(node, headers))
        ):
            # A node with no record in memory is read afresh, unless it is one the trust
            # watch knows, signing with its approved key: every record was loaded when
            # this owner took over and it writes every new one itself, so there is none
            # to read (only a pending one a registration made, which accepting replaces).
            return [partial(self._fetch_and_judge, msg, node)]
        if marker is not None:
            return self._marker(cluster, node, marker, stored, msg.data, partition)
        if state is not None and judge.judged_before(state.record, stored):
            self.metrics.dropped.labels("late_delivery").inc()
            return []
        try:
            key, verifier = self.verify.check(msg, headers, node, state, fetched)
            moment = self._moment(fetched, partition)
            last_seq = state.record.last_seq if state is not None else -1
            heartbeat = judge.read(msg.data, msg.subject, node, cluster, moment, last_seq=last_seq)
            previous = state.record.last_stored if state is not None else None
            verdict = judge.accept(state, heartbeat, key, stored, moment)
            verdict = self._after_silence(cluster, node, heartbeat, stored, previous, verdict)
            self.ledger.accept(state, verdict, heartbeat, msg.data, key, verifier)
            return self._steps(cluster, node, verdict) if verdict.write else []
        except NeedsFetch:
            return [partial(self._fetch_and_judge, msg, node)]
        except Refused as refusal:
            self.metrics.refused.labels(refusal.kind).inc()
            log.warning(
                "heartbeat refused",
                extra={"node": node, "kind": refusal.kind, "reason": refusal.message},
            )
            return self._refused(cluster, node, refusal, stream_seq)
        except LateDelivery:
            self.metrics.dropped.labels("late_delivery").inc()
            log.debug("older heartbeat delivered late; ignored", extra={"node": node})
            return []

    def _after_silence(
        self,
        cluster: str,
        node: str,
        heartbeat: Heartbeat,
        stored: Stored,
        previous: float | None,
        verdict: Verdict,
    ) -> Verdict:
        """A heartbeat whose node's previous one (stored at ``previous``) came before a
        silence of the whole stream: noted for the outage's one alert, its own gap alerts
        dropped unless the silence outlasted ``bus_outage_max`` (the outage module)."""
        if previous is None:
            return verdict
        silence = self.ledger.pulse.silence_between(previous, stored.at, heartbeat.stale_after)
        if silence is None:
            return verdict
        self.ledger.outages.note(node, cluster, silence, heartbeat.stale_after, time.time())
        if self.ledger.outages.told_per_node(silence):
            return verdict
        alerts = [alert for alert in verdict.alerts if alert.kind not in GAP_KINDS]
        return verdict._replace(alerts=alerts)

    def _moment(self, fetched: bool, partition: int) -> Moment:
        """What the judge is told of this moment: the clocks, the limits, whether the
        node was just read afresh and when ``partition`` was last read to its end."""
        return Moment(
            now=time.time(),
            monotonic=time.monotonic(),
            max_skew=self.config.max_skew,
            max_jump=self.config.max_seq_jump,
            fetched=fetched,
            caught_up=self.ownership.caught_up(partition),
        )

    async def _fetch_and_judge(self, msg: Msg, node: str) -> None:
        """The slow path: read the node's trusted key and record afresh (an approval, a
        new key or an operator's ``reset-seq`` a moment ago), then judge again."""
        await self.verify.fetch(node)
        if not await self.reads.refresh(node):
            return
        try:
            steps = self.judge(msg, fetched=True)
        finally:
            self.verify.forget(node)
            self._after_judging()
        for step in steps:
            await step()

    def _after_judging(self) -> None:
        """The bodies accepted packed and counted (:meth:`Ledger.settle`), the newest
        delivery handed to the metrics: once per batch, not per heartbeat."""
        self.ledger.settle()
        if self._last_delivery is not None:
            self.metrics.processed(*self._last_delivery)
            self._last_delivery = None

    def _marker(
        self, cluster: str, node: str, reason: str, stored: Stored, body: bytes, partition: int
    ) -> list[Step]:
        """A TTL marker makes the node stale, if it can be the server's; a forged one is
        counted and ignored."""
        state = self.ledger.nodes.get(node)
        moment = self._moment(False, partition)
        try:
            verdict = judge.marker(state.record if state else None, reason, body, stored, moment)
        except judge.Forged:
            self.metrics.dropped.labels("forged_marker").inc()
            log.warning("forged TTL marker ignored", extra={"node": node, "reason": reason})
            return []
        self.metrics.markers.inc()
        if state is None or verdict is None:
            return []
        beat = state.record.heartbeat
        since = self.ledger.pulse.silent_since(stored.at, self.config.bus_outage_max)
        held = (
            Held(stored.at, reason, beat.stale_after, beat.interval, stored.stream_seq, since)
            if beat
            else None
        )
        if held is not None and self.ledger.pulse.silent(stored.at, held.stale_after):
            # The whole stream was silent before this marker: the bus's silence, maybe
            # not the node's. Held until heartbeats flow again (see the silence module).
            log.info(
                "TTL marker after a silence of the stream; held",
                extra={"node": node, "marked_at": round(stored.at, 3)},
            )
            self.ledger.held.hold(node, held)
            return []
        return [partial(self._confirm_stale, cluster, node, verdict, held)]

    async def _confirm_stale(
        self, cluster: str, node: str, verdict: Verdict, held: Held | None
    ) -> None:
        """Make the node stale as its marker says, unless FLEET_HB_IN holds a newer
        heartbeat of it (FLEET_HB fell behind its source while others' heartbeats were
        still stored: the node beats) or cannot tell: then the marker is held
        (:meth:`Ownership.hold_on`)."""
        state = self.ledger.nodes.get(node)
        if state is None:
            return
        key = await self.verify.store.trusted_key(node)
        if held is not None and await self.ownership.hold_on(node, state.record, key, held):
            log.info(
                "marker held: FLEET_HB_IN says the node beats, or cannot say", extra={"node": node}
            )
            return
        self.ledger.mark_stale(node, state, verdict.record)
        for step in self._steps(cluster, node, verdict):
            await step()

    def _refused(self, cluster: str, node: str, refusal: Refused, stream_seq: int) -> list[Step]:
        """The I/O a refusal needs: the refused heartbeat deleted from FLEET_HB, its alert,
        and the write of the refusal noted in the node's record (as :meth:`Ledger.refused`
        says)."""
        alert, noted = self.ledger.refused(node, refusal.kind, refusal.details.get("boot_id", ""))
        # First, and before the fetch is acked: see Ownership.drop.
        steps: list[Step] = [partial(self.ownership.drop, node, stream_seq)]
        if alert:
            refusal.details.setdefault("event", f"s{stream_seq}")
            spec = AlertSpec(refusal.kind, refusal.message, refusal.details)
            steps.append(self._alert(cluster, node, spec))
        if noted:
            steps.append(partial(self.writes.write_quietly, node, "refusal not noted"))
        return steps

    def _steps(self, cluster: str, node: str, verdict: Verdict) -> list[Step]:
        """A verdict's I/O: its alerts, then the record's write (a crash between the two
        raises the alerts again, with the same ids, which JetStream drops)."""
        steps = [self._alert(cluster, node, alert) for alert in verdict.alerts]
        steps.append(partial(self.writes.write, node))
        return steps

    def _alert(self, cluster: str, node: str, alert: AlertSpec) -> Step:
        event = alert.details.pop("event")
        publish = self.alerts.publish
        return partial(
            publish, alert.kind, cluster, node, alert.message, event, alert.details, alert.severity
        )

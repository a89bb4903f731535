"""Fleet HTTP actor (provider side): ``/nodes`` JSON, ``/metrics`` and ``/healthz`` for the
aggregators.

It follows the ``fleet_nodes`` bucket with a KV watcher, so requests are answered from
memory and a scrape costs the NATS server nothing. The records it keeps are the bytes the
bucket holds (:class:`EncodedRecords`), decoded when asked for, and none of a node the
aggregator beside it holds in memory (it answers from that one): an aggregator process
keeps each record once, not twice, and none at all while that aggregator holds every
partition (then it follows no watch: see :meth:`FleetApiActor._follow`). Beside an
aggregator in the same process (``fleetctl aggregator``, ``fleetctl up``) it answers
from that aggregator's in-memory records first (``live``), which are current to the last
heartbeat handled; ``fleet_nodes`` is only as fresh as the last state change or
checkpoint. Runs beside an aggregator (``fleetctl aggregator``, unless ``--http-port
-1``). ``/healthz`` is 200 only while every
actor of its process runs and none reports a problem (the heartbeat consumer deleted and
not yet created again, say), as the supervisor tells through ``actor_status``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import ssl
from collections import Counter as Tally
from collections.abc import Callable, Container, Iterator, MutableMapping
from typing import get_args

import msgspec
from aiohttp import web
from nats.js.kv import KeyValue

from actors.fleet import labels
from actors.fleet.config import AggregatorConfig
from actors.fleet.labels import Selector
from actors.fleet.live import reader as live
from actors.fleet.live.held import Held
from actors.fleet.metrics import AggregatorMetrics, node_series
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.http_access import Access, Hosts
from actors.runtime.http_login import Users, is_loopback
from actors.runtime.http_sessions import Sessions
from actors.runtime.http_throttle import LoginThrottle
from actors.runtime.supervisor import FatalError, StatusSource
from actors.runtime.tls import server_context
from actors.runtime.web import health_page, prometheus_page, serving
from schemas import codec
from schemas.base import OpenRecordState, RecordState
from schemas.errors import DecodeError, FleetError
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects

STATES: tuple[RecordState, ...] = get_args(RecordState)
MAX_PAGE = 10_000
"""The most records one ``/nodes`` page holds."""
RESYNC_CHECK = 1.0
"""Seconds between checks whether the aggregator beside this API let its nodes go (lost
the heartbeat lease): the records it held are then read from ``fleet_nodes`` again."""

log = logging.getLogger(__name__)


class RecordSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What /metrics counts of a record: decoding only this skips the rest fast (a view
    of a ``NodeRecord`` for reading, not a wire type)."""

    cluster: str
    state: OpenRecordState


class EncodedRecords(MutableMapping[str, NodeRecord]):
    """Records by node, kept as their JSON bytes (one object each, a third of the
    decoded record's memory) and decoded on access; ``raw`` is the bytes by node."""

    def __init__(self) -> None:
        self.raw: dict[str, bytes] = {}

    def __getitem__(self, node: str) -> NodeRecord:
        return codec.decode(self.raw[node], NodeRecord, node)

    def __setitem__(self, node: str, record: NodeRecord) -> None:
        self.raw[node] = codec.encode(record)

    def __delitem__(self, node: str) -> None:
        del self.raw[node]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def readable(self, skip: Container[str]) -> dict[str, NodeRecord]:
        """Every record of a node not in ``skip``, decoded; an unreadable one left out
        (it was counted when it came)."""
        found: dict[str, NodeRecord] = {}
        for node in self.raw:
            if node not in skip:
                with contextlib.suppress(DecodeError):
                    found[node] = self[node]
        return found

    def summaries(self, skip: Container[str]) -> list[RecordSummary]:
        """:class:`RecordSummary` of every record of a node not in ``skip``."""
        found: list[RecordSummary] = []
        for node, value in self.raw.items():
            if node not in skip:
                with contextlib.suppress(DecodeError):
                    found.append(codec.decode(value, RecordSummary, node))
        return found


def exposure(config: AggregatorConfig, app: web.Application) -> ssl.SSLContext | None:
    """TLS and the access checks of the HTTP port (:mod:`actors.runtime.http_access`), as
    configured: the Host of every request; a login for every request with a users file,
    or with the dashboard's commands on (loopback too). Served beyond loopback with the
    dashboard on, TLS and a users file are required: a FatalError says what to set."""
    tls = None
    if config.http_tls_cert or config.http_tls_key:
        tls = server_context(config.http_tls_cert, config.http_tls_key)
    if config.dashboard and not is_loopback(config.http_host):
        if tls is None or not config.http_users_file:
            raise FatalError(
                f"http_host {config.http_host} serves the dashboard beyond this machine: set "
                "http_tls_cert, http_tls_key and http_users_file (or dashboard = false)"
            )
    users = Users(config.http_users_file) if config.http_users_file else None
    sessions = None
    if users is not None or (config.dashboard and config.allow_ui_commands):
        sessions = Sessions(config.ui_session_lifetime, config.ui_session_idle)
    try:
        hosts = Hosts(config.http_host, config.http_public_names)
    except ValueError as exc:
        raise FatalError(f"http_public_names: {exc}") from None
    throttle = LoginThrottle(config.http_login_attempts)
    Access(hosts, sessions, users, throttle, secure=tls is not None).install(app)
    return tls


class FleetApiActor:
    """Watches the fleet_nodes bucket; publishes nothing; serves /nodes, /nodes/<node>,
    /metrics, /healthz."""

    name = "fleet_api"

    def __init__(
        self,
        config: AggregatorConfig,
        bus: Bus,
        metrics: AggregatorMetrics,
        actor_status: StatusSource,
        live: Held | None = None,
        routes: Callable[[web.Application], None] | None = None,
    ) -> None:
        self.config = config
        self.routes = routes
        """Adds more routes to the app (the dashboard's), if given."""
        self.bus = bus
        self.subjects = Subjects(config.prefix)
        self.metrics = metrics
        self.actor_status = actor_status
        self.port: int | None = None
        """The bound port once serving (``http_port = 0`` picks a free one)."""
        self.records = EncodedRecords()
        self._skipped = False
        """A node was left out of ``records`` because ``live`` held it."""
        self._missed = False
        """A record was left out while the aggregator was loading."""
        self.live = live
        """The nodes the aggregator in this process holds (its ``view``), if there is one."""

    def current(self) -> dict[str, NodeRecord]:
        """Every record: the live one where the aggregator beside this API owns the node
        (slim: :meth:`live_records` answers it whole), else the one in ``fleet_nodes``."""
        held = self.live.items() if self.live is not None else []
        merged = self.records.readable(self.live or ())
        merged.update(held)
        return merged

    def record(self, node: str) -> NodeRecord | None:
        whole = self.live.whole(node) if self.live else None
        return whole if whole is not None else self.records.get(node)

    async def _follow(self, bucket: KeyValue) -> None:
        """Mirror ``fleet_nodes`` into ``records``; a deleted or unreadable record drops
        out, and so does one of a node the aggregator beside this API holds. When that
        aggregator lets its nodes go, the watch starts again (every current record).
        While it holds every partition there is no watch: every record is of a node it
        holds, or one it takes in at its next full sweep (a registration another
        aggregator answered), and the watch would take in each of its own writes only to
        drop it: every first contact's record and every checkpoint (1,667 a second at
        100,000 nodes). Without them the 100,000-node bench's lag peaked at 16 to 24 s, not
        27 s (docs/performance.md, "The aggregator at fleet scale")."""
        if self.live is not None:
            # The aggregator beside this API may be taking the lease and about to load
            # every record: the watch starts once the load is done, not during it, when
            # it would take in every record only to drop it (the load holds them) and
            # then start again (100,000 records read twice more in a cold start). A
            # standby's API starts after the lease's wait.
            waits = round(10 * (self.config.lease_ttl + RESYNC_CHECK) / RESYNC_CHECK)
            while self._loading() or (not self._holding() and waits > 0):
                waits -= 1
                await asyncio.sleep(RESYNC_CHECK / 10)
        while True:
            self.records.raw.clear()
            if self._everything():
                await asyncio.sleep(RESYNC_CHECK)  # checked as often as a lost partition
                continue
            self._skipped = self._missed = False
            released = self._released()
            follower = asyncio.create_task(self._follow_once(bucket), name="fleet-http-watch")
            try:
                while not follower.done() and not (
                    (self._skipped and not self._holding())
                    or (self._missed and not self._loading())
                    or (self._released() != released and not self._loading())
                    or self._everything()
                ):
                    await asyncio.wait([follower], timeout=RESYNC_CHECK)
                    self._prune()
            finally:
                follower.cancel()
                results = await asyncio.gather(follower, return_exceptions=True)
            if isinstance(results[0], Exception):
                raise results[0]

    def _everything(self) -> bool:
        return self.live is not None and self.live.everything

    def _loading(self) -> bool:
        return self.live is not None and self.live.loading

    def _released(self) -> int:
        """How often the aggregator beside this API let nodes go: the records it skipped
        of those nodes are read again (another aggregator holds them now)."""
        return self.live.released if self.live is not None else 0

    def _holding(self) -> bool:
        """Whether the aggregator beside this API holds (or is loading) nodes: while it
        does, the records it skipped are its; once it does not, they are read again."""
        return bool(self.live) or self._loading()

    def _prune(self) -> None:
        """Drop the records of nodes the aggregator beside this API took into memory
        since they came (a cold start loads them while the watch delivers them)."""
        live = self.live
        if live and self.records.raw:
            for node in [node for node in self.records.raw if node in live]:
                del self.records.raw[node]
            self._skipped = True

    async def _follow_once(self, bucket: KeyValue) -> None:
        def on_change(node: str, value: msgspec.Raw | None) -> None:
            if value is None:
                self.records.raw.pop(node, None)
            elif self.live is not None and node in self.live:
                # Not even decoded: the aggregator's own write of a node it holds.
                self.records.raw.pop(node, None)
                self._skipped = True
            elif self.live is not None and self.live.loading:
                # The aggregator is loading every record: the watch starts again once it
                # is done (see _follow), for the records it did not take.
                self.records.raw.pop(node, None)
                self._missed = True
            else:
                body = bytes(value)
                try:
                    codec.decode(body, NodeRecord, node)
                except DecodeError:
                    on_unreadable(node)
                    self.records.raw.pop(node, None)
                    return
                self.records.raw[node] = body

        def on_unreadable(node: str) -> None:
            self.metrics.records_unreadable.inc()

        await kv.follow(bucket, msgspec.Raw, on_change, on_unreadable=on_unreadable)

    def listing(
        self, cluster: str | None, state: str | None, selectors: list[Selector] | None = None
    ) -> list[NodeRecord]:
        return [
            record
            for _, record in sorted(self.current().items())
            if (cluster is None or record.cluster == cluster)
            and (state is None or record.state == state)
            and labels.matches(record.labels, selectors or [])
        ]

    async def nodes_page(self, request: web.Request) -> web.Response:
        """``/nodes[?cluster=&state=][&label=key=value...][&limit=N&after=NODE]``: every
        matching record (labels repeatable, all must match; a bad selector is a 400 naming
        it), or with ``limit`` one page of them in node order after ``after``; a page that
        is not the last names the next ``after`` in the ``Next-After`` header."""
        try:
            selectors = labels.parse_selectors(request.query.getall("label", []))
        except FleetError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        found = self.listing(request.query.get("cluster"), request.query.get("state"), selectors)
        headers: dict[str, str] = {}
        if "limit" in request.query:
            try:
                limit = max(1, min(int(request.query["limit"]), MAX_PAGE))
            except ValueError:
                return web.json_response({"error": "limit is not a number"}, status=400)
            after = request.query.get("after", "")
            start = bisect.bisect_right([record.node_id for record in found], after)
            page = found[start : start + limit]
            if start + limit < len(found):
                headers["Next-After"] = page[-1].node_id
            found = page
        return web.Response(
            body=msgspec.json.encode(await self.live_records(found)),
            content_type="application/json",
            headers=headers,
        )

    async def node_page(self, request: web.Request) -> web.Response:
        record = self.record(request.match_info["node"])
        if record is None:
            return web.json_response({"error": "no such node"}, status=404)
        (answer,) = await self.live_records([record])
        return web.Response(body=codec.encode(answer), content_type="application/json")

    async def live_records(self, records: list[NodeRecord]) -> list[NodeRecord]:
        """``records`` (as :class:`live.LiveRecord`) with each node's latest accepted
        heartbeat: from the aggregator beside this API for the nodes it holds (its memory
        is that heartbeat), read from FLEET_HB for the rest (:mod:`actors.fleet.live.reader`).
        The dashboard's pages read through here too."""
        held: list[live.LiveRecord] = []
        others: list[NodeRecord] = []
        for record in records:
            whole = self.live.whole(record.node_id) if self.live is not None else None
            if whole is not None:
                held.append(msgspec.structs.replace(live.as_live(whole), live=True))
            else:
                others.append(record)
        read = await live.overlay(self.bus, self.subjects, others, self.config.durable)
        shown = {r.node_id: r for r in await live.fleet_facts(self.bus, self.subjects, held)}
        shown.update((record.node_id, record) for record in read)
        return [shown[record.node_id] for record in records]

    async def metrics_page(self, request: web.Request) -> web.Response:
        records: list[RecordSummary | NodeRecord] = [*self.records.summaries(self.live or ())]
        held = [record for _, record in self.live.items()] if self.live is not None else []
        records += held
        counts = Tally(record.state for record in records)
        for state in STATES:
            self.metrics.nodes.labels(state).set(counts.get(state, 0))
        # Every state of every cluster that has a record, zeros included, so an alert on
        # a cluster's active nodes falling low can fire; a cluster with none drops out.
        self.metrics.cluster_nodes.clear()
        by_cluster = Tally((record.cluster, record.state) for record in records)
        for cluster in {record.cluster for record in records}:
            for state in STATES:
                count = by_cluster.get((cluster, state), 0)
                self.metrics.cluster_nodes.labels(cluster, state).set(count)
        return prometheus_page(self.metrics.registry, node_series(held))

    async def healthz(self, request: web.Request) -> web.Response:
        return health_page(self.actor_status())

    async def run(self, ready: Callable[[], None]) -> None:
        bucket = await self.bus.kv(self.subjects.bucket_name(BUCKET_NODES))
        follower = asyncio.create_task(self._follow(bucket), name="fleet-http-kv")
        app = web.Application()
        app.router.add_get("/nodes", self.nodes_page)
        app.router.add_get("/nodes/{node}", self.node_page)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/healthz", self.healthz)
        if self.routes is not None:
            self.routes(app)
        tls = exposure(self.config, app)
        try:
            async with serving(app, self.config.http_host, self.config.http_port, tls=tls) as port:
                self.port = port
                ready()
                await follower  # runs until cancelled; its failure restarts this actor
        finally:
            self.port = None
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

"""Fleet HTTP actor (provider side): ``/nodes`` JSON, ``/metrics`` and ``/healthz`` for the
aggregators.

It answers from the process's live feed (:class:`actors.fleet.live.feed.NodeFeed`), so
requests are answered from memory and a scrape costs the NATS server nothing: the nodes
the aggregator beside it holds from that aggregator's memory (current to the last
heartbeat handled), the others from the feed's watch of ``fleet_nodes`` (current to
their owner's last write); ``/nodes`` and ``/nodes/<id>`` add each node's latest
accepted heartbeat (:meth:`FleetApiActor.live_records`). An API with no feed handed to
it follows its own. Runs beside an aggregator (``fleetctl aggregator``, unless
``--http-port -1``). ``/healthz`` is 200 only while every actor of its process runs and
none reports a problem (the heartbeat consumer deleted and not yet created again, say),
as the supervisor tells through ``actor_status``.
"""

from __future__ import annotations

import bisect
import logging
import ssl
from collections import Counter as Tally
from collections.abc import Callable
from typing import get_args

import msgspec
from aiohttp import web

from actors.fleet import labels
from actors.fleet.config import AggregatorConfig
from actors.fleet.labels import Selector
from actors.fleet.live import reader as live
from actors.fleet.live.feed import NodeFeed, followed
from actors.fleet.live.fleet_facts import fleet_facts
from actors.fleet.live.held import Held
from actors.fleet.metrics import AggregatorMetrics, node_series
from actors.runtime.bus import Bus
from actors.runtime.http_access import Access, Hosts
from actors.runtime.http_login import Users, is_loopback
from actors.runtime.http_sessions import Sessions
from actors.runtime.http_throttle import LoginThrottle
from actors.runtime.supervisor import FatalError, StatusSource
from actors.runtime.tls import server_context
from actors.runtime.web import health_page, prometheus_page, serving
from schemas import codec
from schemas.base import RecordState
from schemas.errors import FleetError
from schemas.messages import NodeRecord
from schemas.subjects import Subjects

STATES: tuple[RecordState, ...] = get_args(RecordState)
MAX_PAGE = 10_000
"""The most records one ``/nodes`` page holds."""

log = logging.getLogger(__name__)


def listed(
    record: NodeRecord, cluster: str | None, state: str | None, selectors: list[Selector]
) -> bool:
    """Whether ``record`` is one ``/nodes`` lists for these filters (labels: all must
    match)."""
    return (
        (cluster is None or record.cluster == cluster)
        and (state is None or record.state == state)
        and labels.matches(record.labels, selectors)
    )


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
        feed: NodeFeed | None = None,
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
        self._own_feed = feed is None
        self.feed = feed or NodeFeed(bus, self.subjects, live, metrics, config.lease_ttl)
        """The records it answers from: the process's feed, or its own over ``live`` (the
        nodes the aggregator in this process holds, its ``view``, if there is one)."""
        self.live = self.feed.held

    def current(self) -> dict[str, NodeRecord]:
        """Every record: the live one where the aggregator beside this API owns the node
        (slim: :meth:`live_records` answers it whole), else the one in ``fleet_nodes``."""
        return self.feed.current()

    def record(self, node: str) -> NodeRecord | None:
        return self.feed.record(node)

    @property
    def complete(self) -> bool:
        """Whether :meth:`current` has every node (the live feed's ``complete``)."""
        return self.feed.complete

    async def every_record(self) -> list[NodeRecord]:
        """Every record in node order: the live feed's; while the feed is not complete (a
        watch catching up after the aggregator beside it let nodes go), every record as
        ``fleet_nodes`` holds it, so no node is missing from a list for a moment."""
        if self.feed.complete:
            return [record for _, record in sorted(self.current().items())]
        return await live.stored_records(self.bus, self.subjects)

    async def listing(
        self, cluster: str | None, state: str | None, selectors: list[Selector] | None = None
    ) -> list[NodeRecord]:
        return [
            record
            for record in await self.every_record()
            if listed(record, cluster, state, selectors or [])
        ]

    async def page(
        self,
        cluster: str | None,
        state: str | None,
        selectors: list[Selector],
        after: str,
        limit: int,
    ) -> tuple[list[NodeRecord], bool]:
        """The first ``limit`` matching records in node order after ``after``, and whether
        more match. From the live feed, only the nodes walked are decoded, after a sort of
        the names: a page of 1,000 from every record decoded and sorted took 0.06 s at
        100,000 nodes held and 0.58 s with half of them held elsewhere (a walk of the fleet
        6 s to 58 s); 0.02 s either way now. While the feed is not complete, from every
        record (:meth:`listing`)."""
        if not self.feed.complete:
            found = await self.listing(cluster, state, selectors)
            start = bisect.bisect_right([record.node_id for record in found], after)
            return found[start : start + limit], start + limit < len(found)
        names = sorted(self.feed.nodes())
        page: list[NodeRecord] = []
        for node in names[bisect.bisect_right(names, after) :]:
            record = self.feed.kept(node)
            if record is None or not listed(record, cluster, state, selectors):
                continue
            if len(page) == limit:
                return page, True
            page.append(record)
        return page, False

    async def nodes_page(self, request: web.Request) -> web.Response:
        """``/nodes[?cluster=&state=][&label=key=value...][&limit=N&after=NODE]``: every
        matching record (labels repeatable, all must match; a bad selector is a 400 naming
        it), or with ``limit`` one page of them in node order after ``after``; a page that
        is not the last names the next ``after`` in the ``Next-After`` header."""
        try:
            selectors = labels.parse_selectors(request.query.getall("label", []))
        except FleetError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        cluster, state = request.query.get("cluster"), request.query.get("state")
        headers: dict[str, str] = {}
        if "limit" in request.query:
            try:
                limit = max(1, min(int(request.query["limit"]), MAX_PAGE))
            except ValueError:
                return web.json_response({"error": "limit is not a number"}, status=400)
            after = request.query.get("after", "")
            found, more = await self.page(cluster, state, selectors, after, limit)
            if more:
                headers["Next-After"] = found[-1].node_id
        else:
            found = await self.listing(cluster, state, selectors)
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
                held.append(live.as_live(whole, live=True))
            else:
                others.append(record)
        read = await live.overlay(self.bus, self.subjects, others, self.config.durable)
        shown = {r.node_id: r for r in await fleet_facts(self.bus, self.subjects, held)}
        shown.update((record.node_id, record) for record in read)
        return [shown[record.node_id] for record in records]

    async def metrics_page(self, request: web.Request) -> web.Response:
        records = self.feed.summaries()
        held = [record for _, record in self.live.items()] if self.live is not None else []
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
        app = web.Application()
        app.router.add_get("/nodes", self.nodes_page)
        app.router.add_get("/nodes/{node}", self.node_page)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/healthz", self.healthz)
        if self.routes is not None:
            self.routes(app)
        tls = exposure(self.config, app)
        try:
            async with (
                followed(self.feed, self._own_feed) as following,
                serving(app, self.config.http_host, self.config.http_port, tls=tls) as port,
            ):
                self.port = port
                ready()
                await following  # runs until cancelled; its failure restarts this actor
        finally:
            self.port = None

"""The fleet dashboard: a live web page at ``/`` on the aggregator's HTTP port, and its
pages for GPUs, placed workloads, the remediation policy and maintenance windows.

It reads what the fleet API reads (:class:`~.parts.FleetView`: every node's record, and
the latest accepted heartbeat of the nodes a page shows), the fleet's facts beside the
records (:mod:`.facts`) and the alert feed, and renders HTML on the server (:mod:`.parts`
says what each page shows). Each open page holds one server-sent event stream: every
:data:`PUSH_EVERY` seconds the server renders the page's live parts again and sends those
that changed, which the page's script patches in place (what the reader opened stays
open). The fleet the pages read is one snapshot for all of them (:class:`Snapshot`),
kept longer when building it costs more (at most :data:`MAX_SHARE` of the time), so
open pages cost a bounded share of the aggregator whatever the fleet's size; it is built
again in the background, so a page never waits for a pass over every node (its counts
and order may be one refresh older than its rows' values). The table
sorts (problems first), filters and pages on the server (50 rows a page), so the browser
never holds the fleet.

Background work: the alert feed (``FLEET_ALERTS`` from an hour back, then as stored),
folded into conditions (:mod:`.conditions`); the latest command results per node
(``fleet.result.>``); the partitions' holders and lag (every :data:`PARTITIONS_EVERY`
s); the facts (every :data:`~.facts.FACTS_EVERY` s); the charts' history of the nodes
this aggregator holds (:mod:`.history`) and of the fleet (:mod:`.fleet_history`), sampled
every ``dashboard_history_interval``.

Read-only unless the aggregator runs with ``allow_ui_commands`` and an operator key
(``ui_key_file``): then every request needs a login (the port's access checks,
:mod:`actors.runtime.http_access`: a one-time link redeemed at ``/ui/login``, or a user
of the users file), and a node page has cordon, drain and uncordon buttons, confirmed in
the browser and sent as the same signed commands ``fleetctl`` sends, from a form that
carries its session's current token (replaced after every post) and must come from the
page's own origin. Every other page only reads.

Event streams are bounded: at most ``dashboard_streams_per_client`` per login session
and :data:`MAX_STREAMS` in all, each closed after ``dashboard_stream_lifetime`` seconds
(the page opens another), when its session ends, or when its reader stops reading. On a
port without logins (read-only, on loopback) every local process is trusted to read, and
none can be told from another (one address): only the total and the lifetime bound them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from importlib import resources
from urllib.parse import urlencode

from aiohttp import web
from nats.aio.msg import Msg

from actors.fleet.config import AggregatorConfig
from actors.fleet.live.state_index import read_index
from actors.fleet.operator.commands import new_command, publish_command
from actors.fleet.storage import leases
from actors.fleet.views import history as streams_history
from actors.fleet.views.dashboard import pages, panels, parts, render
from actors.fleet.views.dashboard.attention import tally
from actors.fleet.views.dashboard.conditions import Conditions
from actors.fleet.views.dashboard.facts import Facts
from actors.fleet.views.dashboard.fleet_history import FleetHistory, points_for
from actors.fleet.views.dashboard.held_nodes import HeldNodes
from actors.fleet.views.dashboard.history import History
from actors.fleet.views.dashboard.parts import FleetView, Parts
from actors.fleet.views.dashboard.render import Query
from actors.fleet.views.dashboard.table import Snapshot, gpu_query_of, query_of
from actors.runtime.bus import Bus
from actors.runtime.http_access import ACCESS, session_of
from actors.runtime.login_links import LOGIN_PATH
from actors.runtime.subscriptions import listening
from actors.runtime.web import kept_open
from schemas import codec, signing
from schemas.errors import DecodeError, FleetError, SignatureError
from schemas.messages import (
    Action,
    Alert,
    CommandResult,
    Cordon,
    Drain,
    Heartbeat,
    MaintenanceWindow,
    NodeRecord,
    Uncordon,
)
from schemas.signing import KeyPair
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

PUSH_EVERY = 1.0
"""Seconds between two renders of a page's live parts."""
MAX_SHARE = 0.1
"""The share of the aggregator's time the pages' renders may take: a snapshot that took
``t`` to build is kept ``t / MAX_SHARE`` seconds (at least PUSH_EVERY)."""
PARTITIONS_EVERY = 5.0
ALERT_FEED = 200
"""Alerts kept for the raw feed: the newest info ones, and apart the newest warning and
critical ones (an info flood never pushes those out)."""
DECISIONS = 200
"""The remediation policy's alerts kept for the policy page (the newest)."""
FEED_SINCE = 3600.0
RESULTS_PER_NODE = 10
RESULT_NODES = 10_000
"""Nodes whose latest results are kept (the least recently updated go first)."""
FIRST_SAMPLE = 5.0
"""Seconds after start of the charts' first point."""
SAMPLE_CHUNK = 1000
"""Nodes sampled between two yields to the event loop."""
MAX_STREAMS = 64
"""Event streams open at once; more are answered 503 (each holds a connection)."""
WRITE_TIMEOUT = 10.0
"""Seconds one write to an event stream may wait for its reader; then it is closed."""
STATIC = ("dashboard.css", "dashboard.js")
FIRST_ONLY = frozenset({"table"})
"""Parts a page is rendered with once, never streamed (the table's live parts are its
rows and pager)."""


def event(name: str, data: str) -> bytes:
    """One server-sent event; each line of ``data`` its own ``data:`` line."""
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"event: {name}\n{lines}\n".encode()


def live(element: str, part: str, tag: str = "div", klass: str = "") -> str:
    """An element the page's script patches from the stream's events of its id."""
    attribute = f' class="{klass}"' if klass else ""
    return f'<{tag} id="{element}"{attribute} data-live>{part}</{tag}>'


class DashboardActor:
    """Serves the pages' routes (added to the fleet API's app by :meth:`routes`) and keeps
    the feeds they show; publishes only the commands an operator confirms."""

    name = "dashboard"

    def __init__(
        self,
        config: AggregatorConfig,
        bus: Bus,
        view: FleetView,
        held: HeldNodes,
        key: KeyPair | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.view = view
        self.held = held
        self.key = key if config.allow_ui_commands else None
        self.subjects = Subjects(config.prefix)
        self.history = History(config.dashboard_history_points)
        self.fleet_history = FleetHistory(points_for(config.dashboard_history_interval))
        self.alerts = streams_history.AlertFeed(ALERT_FEED)
        self._alert_seq = 0
        self.conditions = Conditions()
        self.decisions: deque[Alert] = deque(maxlen=DECISIONS)
        self.results: dict[str, deque[CommandResult]] = {}
        self.partitions: list[leases.PartitionStatus] = []
        self.streams: Counter[str] = Counter()
        """Open event streams by session key ("" for those of a port without logins)."""
        self._snapshot: Snapshot | None = None
        self._building: asyncio.Task[None] | None = None
        """The snapshot being built in the background, if one is."""
        self.facts = Facts(bus, self.subjects)

    def heartbeat(self, record: NodeRecord) -> Heartbeat | None:
        return self.held.heartbeat(record.node_id) or record.heartbeat

    def held_note(self) -> str:
        if self.held.everything:
            return "of every node"
        return f"of the {len(self.held.nodes())} nodes this aggregator holds"

    # ----------------------------------------------------------------- routes

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/", self.overview)
        app.router.add_get("/ui/nodes/{node}", self.node_page)
        app.router.add_get("/ui/gpus", self.gpus_page)
        app.router.add_get("/ui/workloads", self.workloads_page)
        app.router.add_get("/ui/policy", self.policy_page)
        app.router.add_get("/ui/maintenance", self.maintenance_page)
        app.router.add_get("/ui/events", self.events)
        app.router.add_post("/ui/nodes/{node}/command", self.command)
        app.router.add_get("/ui/static/{name}", self.static)
        if self.key is not None:
            app.router.add_get(LOGIN_PATH, self.login)

    async def login(self, request: web.Request) -> web.Response:
        """A one-time link (``fleetctl dashboard``) exchanged for a session cookie."""
        assert self.key is not None  # routed only with commands on
        if not request.app[ACCESS].log_in_with_link(request, self.key.public_key):
            raise web.HTTPForbidden(
                text="this login link is used, expired or not this dashboard's: "
                "print another with 'fleetctl dashboard'\n"
            )
        raise web.HTTPSeeOther("/", headers={"Cache-Control": "no-store"})

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        text = resources.files("actors.fleet.views.dashboard").joinpath("static", name).read_text()
        kind = "text/css" if name.endswith(".css") else "text/javascript"
        return web.Response(text=text, content_type=kind)

    def fleet(self) -> Snapshot:
        """The fleet as the pages show it: the newest snapshot built, one for every open
        page. The first is built at once; after that, one older than its ``refresh`` is
        built again in the background (its counting and ordering in a thread) while the
        pages read the one before: no page waits for a pass over every node (at 100,000
        nodes a few tenths of a second). A build takes at most a tenth of the time
        (:data:`MAX_SHARE`): pages then update every few seconds."""
        now = time.monotonic()
        if self._snapshot is None:
            self._snapshot = self._build(self.view.current(), now)
        elif now - self._snapshot.built >= self._snapshot.refresh and self._building is None:
            self._building = asyncio.get_running_loop().create_task(
                self._rebuild(), name="dashboard-snapshot"
            )
        return self._snapshot

    async def _rebuild(self) -> None:
        try:
            # Counted in the build's share: every record read on the loop took 0.5 s with
            # half of 100,000 nodes held elsewhere (decoded), and was left out of it.
            started = time.monotonic()
            records = self.view.current()
            if not self.view.complete and self._snapshot is not None:
                # The feed catches up (the aggregator beside it loads, or let partitions
                # go): a node it lacks keeps its record of the snapshot before, so none is
                # missing for a moment and none is read again (every record of
                # fleet_nodes decoded at once: at 100,000 nodes, seconds of the loop and a
                # gigabyte, which lost the leases of the cold start it came in).
                records = {**self._snapshot.by_node, **records}
            self._snapshot = await asyncio.to_thread(self._build, records, started)
        finally:
            self._building = None

    def _build(self, records: dict[str, NodeRecord], started: float) -> Snapshot:
        """The snapshot of ``records``: counted, ordered, and the table's default order
        found (what the first page shows), from ``started`` (monotonic)."""
        wall = time.time()
        windows = self.facts.in_force(wall)

        def window(record: NodeRecord) -> MaintenanceWindow | None:
            return self.facts.covering(record, wall, windows)

        counted = tally(records.values(), self.facts.holds, window if windows else None)
        snapshot = Snapshot(records, counted, started, PUSH_EVERY)
        snapshot.matching(Query())
        cost = time.monotonic() - started
        snapshot.refresh = max(PUSH_EVERY, cost / MAX_SHARE)
        return snapshot

    def _page(self, title: str, body: str, stream: str, here: str) -> web.Response:
        return web.Response(
            text=render.page(title, body, stream, here),
            content_type="text/html",
            headers={"Cache-Control": "no-store"},
        )

    async def overview(self, request: web.Request) -> web.Response:
        query = query_of(request)
        got = await parts.overview_parts(self, query)
        span = "last day" if query.day else "last hour"
        other = query.url(span="" if query.day else "day")
        body = (
            '<section class="top">'
            + live("counts", got["counts"])
            + live("aggregators", got["aggregators"], klass="aggregators")
            + "</section><section><h2>Conditions</h2>"
            + live("conditions", got["conditions"])
            + '<details class="raw"><summary>raw alert feed (the newest 50)</summary>'
            + live("feed", got["feed"], "ul", "feed")
            + f"</details></section><section><h2>Nodes</h2>{panels.LEGEND}{got['table']}"
            + f"</section><section><h2>Fleet, {span} <small><a "
            f'href="{render.esc(other)}">{"last hour" if query.day else "last day"}</a>'
            "</small></h2>"
            + live("fleet-charts", got["fleet-charts"], klass="charts")
            + "</section>"
        )
        stream = "/ui/events" + query.url(view="overview")
        return self._page("GPU fleet", body, stream, "/")

    async def node_page(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        got = await parts.node_parts(self, node)
        if got is None:
            raise web.HTTPNotFound(text=f"no node {node} in the fleet")
        alerts, results = await streams_history.recent_history(
            self.bus, self.subjects, node, limit=20
        )
        history = render.entries(streams_history.merged(alerts, results))
        actions = ""
        session = session_of(request)
        if self.key is not None and session is not None:
            actions = (
                f"<section><h2>Actions</h2>{render.actions_form(node, session.form_token)}"
                f"<h3>Results</h3>{live('results', got['results'], 'ul')}</section>"
            )
        notice = request.query.get("sent", "")
        sent = f'<p class="notice">{render.esc(notice)}</p>' if notice else ""
        body = (
            f"<section><h2>{render.esc(node)}</h2>{sent}{live('detail', got['detail'])}"
            f"</section><section><h2>Last hour</h2>"
            f"{live('charts', got['charts'], klass='charts')}</section>{actions}"
            f'<section><h2>Recent alerts and results</h2><ul id="history">{history}</ul></section>'
        )
        stream = "/ui/events?" + urlencode({"view": "node", "node": node})
        return self._page(node, body, stream, "")

    async def gpus_page(self, request: web.Request) -> web.Response:
        query = gpu_query_of(request)
        got = await parts.gpu_parts(self, query)
        body = (
            "<section><h2>GPUs</h2><p>Every GPU of the fleet, as <code>fleetctl gpus</code> "
            "lists them: readings from each node's last accepted heartbeat (a node that is "
            f"not beating shows none).</p>{pages.gpu_form(query)}"
            f"{live('gpus', got['gpus'])}</section>"
        )
        stream = "/ui/events" + query.url(view="gpus")
        return self._page("GPUs", body, stream, "/ui/gpus")

    async def _fact_page(
        self, title: str, path: str, view: str, about: str, made: Awaitable[Parts]
    ) -> web.Response:
        got = await made
        body = f"<section><h2>{title}</h2><p>{about}</p>{live(view, got[view])}</section>"
        return self._page(title, body, f"/ui/events?view={view}", path)

    async def workloads_page(self, request: web.Request) -> web.Response:
        about = (
            "Each workload the fleet placed (<code>fleetctl deploy NAME</code> without a "
            "node), its replicas, where they run and why, as <code>fleetctl workloads "
            "--why</code> says."
        )
        made = parts.workloads_parts(self)
        return await self._fact_page("Workloads", "/ui/workloads", "workloads", about, made)

    async def policy_page(self, request: web.Request) -> web.Response:
        about = (
            "The remediation policy's own records (<code>fleetctl policy status</code>): "
            "its breaker, the nodes it holds and why, and its decisions."
        )
        made = parts.policy_parts(self)
        return await self._fact_page("Policy", "/ui/policy", "policy", about, made)

    async def maintenance_page(self, request: web.Request) -> web.Response:
        about = (
            "Maintenance windows (<code>fleetctl maintenance</code>): the nodes they cover "
            "have their alerts recorded but not forwarded."
        )
        made = parts.maintenance_parts(self)
        return await self._fact_page("Maintenance", "/ui/maintenance", "maintenance", about, made)

    def _live_parts(self, request: web.Request) -> Callable[[], Awaitable[Parts | None]]:
        """What the stream of ``request`` renders again at each push: its page's parts."""
        view = request.query.get("view", "node" if "node" in request.query else "overview")
        if view == "node":
            node = request.query.get("node", "")
            return lambda: parts.node_parts(self, node)
        if view == "gpus":
            wanted = gpu_query_of(request)
            return lambda: parts.gpu_parts(self, wanted)
        facts = {
            "workloads": parts.workloads_parts,
            "policy": parts.policy_parts,
            "maintenance": parts.maintenance_parts,
        }
        if view in facts:
            return lambda: facts[view](self)
        query = query_of(request)
        return lambda: parts.overview_parts(self, query)

    async def events(self, request: web.Request) -> web.StreamResponse:
        """The page's live parts (``view`` names the page, the rest of the query is its
        own), rendered again at each push and sent when they changed."""
        session = session_of(request)
        client = session.key if session is not None else ""
        if client and self.streams[client] >= self.config.dashboard_streams_per_client:
            raise web.HTTPTooManyRequests(
                headers={"Retry-After": "5"}, text="too many live pages open in this login\n"
            )
        if self.streams.total() >= MAX_STREAMS:
            raise web.HTTPServiceUnavailable(text="too many live pages open\n")
        render_parts = self._live_parts(request)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
        )
        self.streams[client] += 1
        try:
            await response.prepare(request)
            with kept_open(request):
                await self._stream(request, response, render_parts)
        except (ConnectionResetError, TimeoutError):
            pass  # the page went away, or stopped reading
        finally:
            self.streams[client] -= 1
            if not self.streams[client]:
                del self.streams[client]
        return response

    def _streaming(self, request: web.Request, until: float) -> bool:
        """The stream of ``request`` may go on: within its lifetime, its session live."""
        session = session_of(request)
        if session is not None and not request.app[ACCESS].alive(session):
            return False
        return time.monotonic() < until

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await response.write(data)

    async def _stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        render_parts: Callable[[], Awaitable[Parts | None]],
    ) -> None:
        sent: dict[str, str] = {}
        until = time.monotonic() + self.config.dashboard_stream_lifetime
        await self._write(response, b"retry: 2000\n\n")
        while self._streaming(request, until):
            for name, part in (await render_parts() or {}).items():
                if name in FIRST_ONLY:
                    continue
                digest = hashlib.sha256(part.encode()).hexdigest()
                if sent.get(name) != digest:
                    await self._write(response, event(name, part))
                    sent[name] = digest
            await asyncio.sleep(max(0.0, min(self.fleet().refresh, until - time.monotonic())))
        # The page opens a new stream at once (its login and its slot checked again).
        await self._write(response, event("reconnect", ""))

    async def command(self, request: web.Request) -> web.Response:
        """A confirmed cordon, drain or uncordon from a node page, sent signed."""
        node = request.match_info["node"]
        if self.key is None:
            raise web.HTTPForbidden(
                text="commands from the page are off (aggregator without --allow-ui-commands)"
            )
        if request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
            raise web.HTTPForbidden(text="a command must come from this dashboard's own page")
        session = session_of(request)
        form = await request.post()
        if session is None or not session.take_form_token(str(form.get("token", ""))):
            raise web.HTTPForbidden(text="stale or foreign form: reload the page")
        action_name = str(form.get("action", ""))
        actions: dict[str, Action] = {"cordon": Cordon(), "drain": Drain(), "uncordon": Uncordon()}
        if action_name not in actions:
            raise web.HTTPBadRequest(text=f"unknown action {action_name[:32]!r}")
        record = self.view.record(node)
        if record is None:
            raise web.HTTPNotFound(text=f"no node {node} in the fleet")
        reason = str(form.get("reason", ""))[:200] or "from the dashboard"
        command = new_command(node, record.cluster, actions[action_name], reason)
        try:
            await publish_command(self.bus, self.subjects, self.key, command)
        except FleetError as exc:
            raise web.HTTPBadGateway(text=str(exc)) from None
        log.info(
            "command sent from the dashboard",
            extra={"node": node, "action": action_name, "command": command.id},
        )
        notice = f"{action_name} sent: id={command.id}"
        raise web.HTTPSeeOther(f"/ui/nodes/{node}?sent={notice}")

    # ----------------------------------------------------------------- feeds

    async def _on_alert(self, entry: streams_history.Entry) -> None:
        if isinstance(entry.message, Alert):
            self._alert_seq += 1
            self.alerts.append((self._alert_seq, entry.message))
            self.conditions.add(entry.message)
            if entry.message.kind in pages.POLICY_KINDS:
                self.decisions.append(entry.message)

    async def _on_result(self, msg: Msg) -> None:
        """A node's signed result, kept only if it verifies against the node's approved key
        and came on the node's own subject."""
        try:
            signer = signing.verify(msg.headers, msg.data)
            result = codec.decode(msg.data, CommandResult, msg.subject)
        except (DecodeError, SignatureError):
            return
        # The node's record alone: every record (``current``) took 25 ms at 100,000 nodes
        # held, 0.5 s with half held elsewhere (decoded), at each of the 3,000 and more
        # results a rolling drain of 1,000 nodes sends.
        record = self.view.record(result.node_id)
        if (
            record is None
            or record.public_key != signer
            or msg.subject != self.subjects.result(record.cluster, record.node_id)
        ):
            return
        kept = self.results.pop(result.node_id, None) or deque(maxlen=RESULTS_PER_NODE)
        kept.append(result)
        self.results[result.node_id] = kept
        if len(self.results) > RESULT_NODES:
            del self.results[next(iter(self.results))]

    async def _follow_partitions(self) -> None:
        while True:
            try:
                self.partitions = await leases.partition_status(
                    self.bus, self.subjects, self.config.durable
                )
            except (FleetError, TimeoutError, OSError) as exc:
                log.warning("partitions not read", extra={"reason": str(exc)})
            await asyncio.sleep(PARTITIONS_EVERY)

    async def _sample(self) -> None:
        """One point of the held nodes' figures: only the nodes that changed since the
        last round are looked at, in chunks between which the event loop runs (the
        others repeat their points: :class:`History`); only those that beat have their
        heartbeat decoded (tens of µs each: 100,000 of them take seconds). The first
        round looks at every held node."""
        self.history.begin(time.time())
        nodes, everything = self.held.changed()
        if everything:
            self.history.keep_only(self.held)
        beats = 0
        for start in range(0, len(nodes), SAMPLE_CHUNK):
            for node in nodes[start : start + SAMPLE_CHUNK]:
                beats += self._sample_node(node)
            await asyncio.sleep(0)
        totals = self.history.kept.totals(beats)
        self.fleet_history.add(time.time(), await self._by_state(), totals)

    def _sample_node(self, node: str) -> int:
        """The node's point of this round if it changed; the heartbeats it sent since."""
        seq = self.held.seq(node)
        if seq is None:
            self.history.forget(node)  # no longer held
            return 0
        if self.history.current(node, seq):
            return 0
        beat = self.held.heartbeat(node)
        if beat is None:
            self.history.blank(node)
            return 0
        return self.history.put(node, beat)

    async def _by_state(self) -> dict[str, int]:
        """The fleet's nodes by state for the fleet chart (deregistered ones left out):
        from the state index where it stands for the records (one small value read per
        partition), else from the pages' snapshot (a pass over every node, which a
        sample once a minute otherwise rebuilt with no page open: 0.7 % of a core at
        100,000 nodes)."""
        index = await read_index(self.bus, self.subjects)
        if index is None:
            return self.fleet().counted.by_state
        counts: Counter[str] = Counter()
        for row in index.counts.values():
            counts.update(row)
        counts.pop("deregistered", None)
        return dict(counts)

    async def _sample_forever(self) -> None:
        # The first round once the aggregator has had a moment to load what it holds.
        await asyncio.sleep(min(FIRST_SAMPLE, self.config.dashboard_history_interval))
        while True:
            await self._sample()
            await asyncio.sleep(self.config.dashboard_history_interval)

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {self.subjects.results(): self._on_result}
        since = time.time() - FEED_SINCE
        async with (
            listening(self.bus, routes),
            streams_history.following_alerts(self.bus, self.subjects, since, self._on_alert),
        ):
            tasks = [
                asyncio.create_task(self._follow_partitions(), name="dashboard-partitions"),
                asyncio.create_task(self._sample_forever(), name="dashboard-history"),
                asyncio.create_task(self.facts.follow(), name="dashboard-facts"),
            ]
            ready()
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

"""What needs a person on the dashboard: each node's concern, the fleet's counts and the
node table's default order, problems first."""

from __future__ import annotations

import time

import msgspec

from actors.fleet.config import AggregatorConfig
from actors.fleet.views.dashboard.actor import MAX_SHARE, DashboardActor
from actors.fleet.views.dashboard.attention import CONCERNS, concern, tally
from actors.fleet.views.dashboard.held_nodes import HeldNodes
from actors.fleet.views.dashboard.render import Query
from actors.fleet.views.dashboard.table import matching
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import MaintenanceWindow, NodeRecord
from schemas.remediation import Hold
from schemas.subjects import BUCKET_NODES, Subjects
from tests.support.dashboard import CountedView
from tests.support.fleet import new_aggregator, wait_for

GAVE_UP = Hold(
    reason_class="gpu", reason="GPU 0 lost", action="cordon", command_id="c", since=1.0,
    needs_attention=True,
)  # fmt: skip
WINDOW = MaintenanceWindow(id="w", since=0.0, until=9e9, by="U")


def record(node: str, state: str, **changes: object) -> NodeRecord:
    made = NodeRecord(node_id=node, cluster="c1", state=state, last_seq=1, last_seen=1.0)
    return msgspec.structs.replace(made, **changes)


def test_concerns_rank_what_needs_a_person() -> None:
    """A node the policy gave up on ranks before an unhealthy one (even cordoned), then
    offline, stale, degraded, refused and pending; a node in a maintenance window, a
    healthy one and a stale node's old health have none or rank as silence."""
    ranks = [
        concern(record("a", "cordoned", health_status="unhealthy"), GAVE_UP, None),
        concern(record("b", "cordoned", health_status="unhealthy"), None, None),
        concern(record("c", "offline"), None, None),
        concern(record("d", "stale", health_status="unhealthy"), None, None),
        concern(record("e", "degraded", health_status="degraded"), None, None),
        concern(record("f", "active", refused="replay"), None, None),
        concern(record("g", "pending"), None, None),
    ]
    assert ranks == list(range(len(CONCERNS)))
    assert concern(record("h", "stale"), None, WINDOW) is None
    assert concern(record("i", "active", health_status="healthy"), None, None) is None
    assert concern(record("j", "cordoned", health_status="healthy"), None, None) is None


def test_the_counts_say_health_policy_and_maintenance_beside_states() -> None:
    """A node cordoned by the policy for a lost GPU at score 49 counts as cordoned, as
    unhealthy, as held by the policy and as needing a person; deregistered nodes do not
    count; a window's node counts as in maintenance and needs nobody."""
    records = [
        record("held", "cordoned", health_status="unhealthy", health_score=49),
        record("hot", "degraded", health_status="degraded"),
        record("quiet", "stale"),
        record("fixing", "stale"),
        record("fine", "active", health_status="healthy"),
        record("gone", "deregistered"),
    ]
    counted = tally(
        records,
        {("c1", "held"): GAVE_UP},
        lambda made: WINDOW if made.node_id == "fixing" else None,
    )
    assert counted.by_state == {"cordoned": 1, "degraded": 1, "stale": 2, "active": 1}
    assert counted.by_cluster == {"c1": counted.by_state}
    assert (counted.unhealthy, counted.degraded) == (1, 1)
    assert (counted.policy_held, counted.policy_needs, counted.maintenance) == (1, 1, 1)
    assert counted.concerns == {"held": 0, "quiet": 3, "hot": 4}
    assert counted.by_concern == {0: 1, 3: 1, 4: 1} and counted.total == 5


def test_the_table_opens_problems_first() -> None:
    """The default order: by concern, then the lowest score, then name; the rest by
    name after them, whatever their names."""
    records = [
        record("a-fine", "active", health_status="healthy", health_score=100),
        record("b-degraded-70", "degraded", health_status="degraded", health_score=70),
        record("c-stale", "stale"),
        record("d-degraded-60", "degraded", health_status="degraded", health_score=60),
        record("e-fine", "active", health_status="healthy", health_score=95),
    ]
    counted = tally(records, {})
    order = [made.node_id for made in matching(records, Query(), counted.concerns)]
    assert order == ["c-stale", "d-degraded-60", "b-degraded-70", "a-fine", "e-fine"]
    by_name = [made.node_id for made in matching(records, Query(sort="node"), counted.concerns)]
    assert by_name == sorted(by_name)


async def test_nodes_the_feed_lacks_keep_their_record_while_it_catches_up(
    bus: NatsBus, prefix: str
) -> None:
    """A snapshot built again while the live feed catches up keeps each node the feed
    lacks with its record of the snapshot before (none missing for a moment) and takes
    the feed's newer records; it reads nothing from fleet_nodes (every stored record
    decoded at once held a 100,000-node aggregator's loop for seconds). Once the feed is
    complete, a node gone from it is gone from the pages."""
    stored = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    await stored.put("z", codec.encode(record("z", "pending")))
    view = CountedView({"a": record("a", "active"), "b": record("b", "stale")})
    config = AggregatorConfig(prefix=prefix, http_port=0)
    held = HeldNodes(new_aggregator(bus, prefix).view)  # never started: holds nothing
    board = DashboardActor(config, bus, view, held)
    first = board.fleet()
    view.complete = False
    view.records = {"b": record("b", "offline")}
    first.built -= first.refresh  # as if a refresh had passed
    catching_up = await wait_for(lambda: board.fleet() is not first and board.fleet())
    assert catching_up.counted.by_state == {"active": 1, "offline": 1}
    view.complete = True
    catching_up.built -= catching_up.refresh
    caught_up = await wait_for(lambda: board.fleet() is not catching_up and board.fleet())
    assert caught_up.counted.by_state == {"offline": 1}


async def test_a_page_never_waits_for_a_pass_over_every_node(bus: NatsBus, prefix: str) -> None:
    """The first snapshot is built at once; once it is older than its refresh, a page gets
    it again at once (no pass over every record on the page's path) while a new one is
    built in the background, with the default table order already found; the next page
    reads the new one."""
    view = CountedView({"a": record("a", "active"), "b": record("b", "stale")})
    config = AggregatorConfig(prefix=prefix, http_port=0)
    held = HeldNodes(new_aggregator(bus, prefix).view)  # never started: holds nothing
    board = DashboardActor(config, bus, view, held)
    first = board.fleet()
    assert view.passes == 1 and first.counted.by_state == {"active": 1, "stale": 1}
    view.records["c"] = record("c", "unhealthy", health_status="unhealthy")
    first.built -= first.refresh  # as if a refresh had passed
    assert board.fleet() is first and view.passes == 1, "the page waited for a build"
    newer = await wait_for(lambda: board.fleet() is not first and board.fleet())
    assert newer.counted.by_state == {"active": 1, "stale": 1, "unhealthy": 1}
    assert [r.node_id for r in newer._found[Query()]] == ["c", "b", "a"]


class SlowView(CountedView):
    """A fleet view whose every record takes ``took`` seconds to read after the first
    read, as decoding half of 100,000 nodes held elsewhere does (0.5 s)."""

    took = 0.3

    def current(self) -> dict[str, NodeRecord]:
        if self.passes:
            time.sleep(self.took)
        return super().current()


async def test_reading_every_record_counts_in_the_snapshots_share(
    bus: NatsBus, prefix: str
) -> None:
    """The time a snapshot's records took to read on the event loop counts in the share of
    the aggregator's time the pages take: the next build waits ten times as long."""
    view = SlowView({"a": record("a", "active")})
    config = AggregatorConfig(prefix=prefix, http_port=0)
    held = HeldNodes(new_aggregator(bus, prefix).view)  # never started: holds nothing
    board = DashboardActor(config, bus, view, held)
    first = board.fleet()
    first.built -= first.refresh  # as if a refresh had passed
    board.fleet()
    newer = await wait_for(lambda: board.fleet() is not first and board.fleet())
    assert newer.refresh >= SlowView.took / MAX_SHARE, newer.refresh

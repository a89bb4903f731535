"""Issue 41: the remediation policy on a fleet of fake-GPU agents under two aggregators at
the default ``checkpoint_interval``, each running the policy: a node that refuses the
policy's key is no phantom hold, a dry run says each would-be action once, a node in
maintenance is left alone."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from actors.fleet.config import AggregatorConfig
from actors.fleet.live import reader as live
from actors.fleet.remediation.actor import RemediationActor
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Alert, MaintenanceWindow
from schemas.remediation import PolicyRecord
from schemas.subjects import BUCKET_MAINTENANCE, BUCKET_POLICY, Subjects
from tests.fleet.test_remediation import inject, policy
from tests.support.fleet import Fleet, wait_for, wait_record

CHECKPOINT = AggregatorConfig().checkpoint_interval
"""The default: these fleets never lean on fast checkpoints."""


async def two_aggregators(fleet: Fleet) -> NatsBus:
    """Two aggregators at the default checkpoint interval; the second one's bus."""
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    second = await fleet.connect("aggregator-2")
    await fleet.start_aggregator(second, checkpoint_interval=CHECKPOINT)
    return second


async def agents(fleet: Fleet, trusting: dict[str, list[str]]) -> None:
    """One fake-GPU agent per node, trusting the given operator keys, each active."""
    for node, keys in trusting.items():
        agent = await fleet.start_agent(fleet.config(node, trust_operators=keys))
        assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    for node in trusting:
        await wait_record(fleet.bus, fleet.prefix, node, lambda r: r.state == "active")


async def policies(fleet: Fleet, second: NatsBus, tmp_path: Path, **settings: Any) -> list[Any]:
    """The policy running beside each aggregator (as ``--policy-file`` starts it)."""
    config, key = policy(tmp_path, **settings)
    actors = [RemediationActor(config, bus, fleet.prefix) for bus in (fleet.bus, second)]
    await fleet.start_supervisor(*actors)
    return [key, *actors]


class Seen:
    """Every command and alert of the test's prefix, as they are published."""

    def __init__(self) -> None:
        self.commands: list[str] = []
        self.alerts: list[Alert] = []

    async def start(self, bus: NatsBus, prefix: str) -> Seen:
        subjects = Subjects(prefix)
        await bus.subscribe(subjects.commands(), self._on_command)
        await bus.subscribe(subjects.alerts(), self._on_alert)
        await bus.flush()
        return self

    async def _on_command(self, msg: Msg) -> None:
        self.commands.append(msg.subject)

    async def _on_alert(self, msg: Msg) -> None:
        self.alerts.append(codec.decode(msg.data, Alert, msg.subject))

    def of(self, kind: str, node: str) -> list[Alert]:
        return [alert for alert in self.alerts if (alert.kind, alert.node_id) == (kind, node)]


async def record(bus: NatsBus, prefix: str) -> PolicyRecord | None:
    return await kv.read(
        await bus.kv(Subjects(prefix).bucket_name(BUCKET_POLICY)), "c1", PolicyRecord
    )


async def rounds(actors: list[RemediationActor], more: int, timeout: float = 60.0) -> None:
    """Wait until every policy actor has decided ``more`` more rounds."""
    wanted = [actor.rounds + more for actor in actors]
    await wait_for(lambda: all(a.rounds >= n for a, n in zip(actors, wanted, strict=True)), timeout)


async def test_a_node_refusing_the_policys_key_is_no_phantom(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """p1 and p2 do not trust the policy's key: each answers its cordon rejected, ends a
    refused hold needing attention (so the views say) with exactly one alert, gets the
    cordon once (not again every round) and is not counted by the breaker: two real XIDs
    then fit a breaker of 3 (counting the two phantoms, four would trip it), and exactly
    those two are cordoned."""
    operator = signing.KeyPair.generate()
    second = await two_aggregators(fleet)
    seen = await Seen().start(bus, prefix)
    key, *actors = await policies(
        fleet, second, tmp_path, breaker_max=3, breaker_percent=100.0, interval=1.0
    )
    trusting = {"p1": [operator.public_key], "p2": [operator.public_key]}
    trusting |= {name: [key.public_key] for name in ("n1", "n2", "n3", "n4")}
    await agents(fleet, trusting)
    for name in ("p1", "p2"):
        await inject(fleet, name, "xid", 79)

    async def refused() -> PolicyRecord | None:
        current = await record(bus, prefix)
        holds = current.holds if current is not None else {}
        return current if all(holds.get(n) and holds[n].refused for n in ("p1", "p2")) else None

    current = await wait_for(refused, timeout=30)
    for name in ("p1", "p2"):
        hold = current.holds[name]
        assert hold.needs_attention and "signed by an untrusted key" in hold.refused
        shown = await live.read_node(bus, Subjects(prefix), name)
        assert shown.policy_hold == "cordon refused: needs attention"
    for name in ("n1", "n2"):
        await inject(fleet, name, "xid", 79)
    for name in ("n1", "n2"):
        await wait_record(bus, prefix, name, lambda r: r.state == "cordoned", timeout=30)
    await rounds(actors, 3)
    current = await record(bus, prefix)
    assert current is not None and current.tripped_at is None and current.base == 6
    assert sorted(current.holds) == ["n1", "n2", "p1", "p2"]
    subjects = Subjects(prefix)
    for name in ("p1", "p2"):
        assert seen.commands.count(subjects.command("c1", name)) == 1
        assert len(seen.of("needs_attention", name)) == 1
    assert sorted(set(seen.commands)) == [
        subjects.command("c1", n) for n in ("n1", "n2", "p1", "p2")
    ]
    for name in ("n3", "n4"):
        assert (await wait_record(bus, prefix, name, lambda r: True)).state == "active"
    assert seen.of("breaker_tripped", "_cluster") == []


async def test_a_dry_run_says_each_would_be_action_once(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """A dry-run policy beside each of two aggregators, over 30 rounds: n1 sick from the
    start and n2 from half-way are each alerted once (not every round, not once per
    aggregator); nothing is sent; policy status's record lists both."""
    second = await two_aggregators(fleet)
    seen = await Seen().start(bus, prefix)
    # What is counted is rounds, not seconds: a quarter-second interval makes them.
    key, *actors = await policies(fleet, second, tmp_path, dry_run=True, interval=0.25)
    await agents(fleet, {name: [key.public_key] for name in ("n1", "n2", "n3")})
    await inject(fleet, "n1", "xid", 79)
    await rounds(actors, 15)
    await inject(fleet, "n2", "xid", 79)
    await rounds(actors, 15)
    await bus.flush()
    for name in ("n1", "n2"):
        [alert] = seen.of("remediation", name)
        assert alert.severity == "info"
        assert alert.message.startswith("dry run, would: cordon: policy: xid: XID 79")
    assert [a for a in seen.alerts if a.kind == "remediation" and a.node_id == "n3"] == []
    assert seen.commands == []
    current = await record(bus, prefix)
    assert current is not None and current.holds == {} and sorted(current.dry) == ["n1", "n2"]


async def test_a_node_in_maintenance_is_not_cordoned_by_the_policy(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """n1, covered by a maintenance window, turns XID-sick: the policy leaves it alone
    and lists it as skipped; n2, not covered, is cordoned."""
    second = await two_aggregators(fleet)
    seen = await Seen().start(bus, prefix)
    key, *actors = await policies(fleet, second, tmp_path, interval=1.0)
    await agents(fleet, {name: [key.public_key] for name in ("n1", "n2", "n3")})
    now = time.time()
    window = MaintenanceWindow(
        id="psu", since=now, until=now + 3600, by=key.public_key, nodes=["n1"], reason="PSU"
    )
    windows = await bus.kv(Subjects(prefix).bucket_name(BUCKET_MAINTENANCE))
    await windows.put("psu", codec.encode(window))
    for name in ("n1", "n2"):
        await inject(fleet, name, "xid", 79)
    await wait_record(bus, prefix, "n2", lambda r: r.state == "cordoned", timeout=30)
    await rounds(actors, 3)
    current = await record(bus, prefix)
    assert current is not None and list(current.holds) == ["n2"]
    assert current.skipped == {"n1": "would cordon (xid): in maintenance window psu"}
    assert (await wait_record(bus, prefix, "n1", lambda r: True)).state == "unhealthy"
    assert seen.commands == [Subjects(prefix).command("c1", "n2")]

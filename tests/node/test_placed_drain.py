"""A node's drain waits for the workloads the fleet placed there (``Deploy.placed``) to be
moved, that is stopped here, within its deadline; a workload deployed by hand does not
hold it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.runtime.bus import NatsBus
from schemas import signing
from schemas.messages import Drain, Uncordon
from schemas.workloads import Deploy, Stop
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, wait_for, wait_record
from tests.support.workloads import killing_leftovers, standin_script

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    with killing_leftovers():
        yield


async def ready_agent(fleet: Fleet, operator: signing.KeyPair, tmp_path: Path) -> None:
    await fleet.start_aggregator()
    config = fleet.config(
        trust_operators=[operator.public_key],
        workload_binaries=[f"llamacpp={standin_script(tmp_path / 'bin')}"],
        workload_stop_grace=2.0,
    )
    await fleet.start_agent(config)
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")


async def deployed(
    bus: NatsBus, prefix: str, operator: signing.KeyPair, results: Results, placed: bool
) -> None:
    action = Deploy(name="chat", engine="llamacpp", model="/m.gguf", gpus=[0], placed=placed)
    command = await send(bus, prefix, operator, action)
    final = await results.final(command.id)
    assert final.status == "done", final.detail


async def test_a_drain_waits_for_placed_workloads_until_they_stop(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """With a placed workload running, a drain reports it as work to move and does not
    finish; once it is stopped (as the reconciler does), the drain ends drained."""
    operator = signing.KeyPair.generate()
    await ready_agent(fleet, operator, tmp_path)
    results = await Results().start(bus, prefix)
    await deployed(bus, prefix, operator, results, placed=True)
    drain = await send(bus, prefix, operator, Drain(deadline=60))
    await wait_for(
        lambda: any("1 placed workloads to move" in r.detail for r in results.of(drain.id))
    )
    assert results.statuses(drain.id)[-1] == "in_progress"
    await send(bus, prefix, operator, Stop(name="chat"))
    final = await results.final(drain.id)
    assert final.status == "done" and final.detail.startswith("drained"), final.detail


async def test_a_drain_deadline_ends_the_wait_and_a_hand_deploy_never_holds_it(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """A placed workload nobody moves holds a drain only until its deadline, which the
    result says; a workload deployed to the node by hand does not hold a drain at all."""
    operator = signing.KeyPair.generate()
    await ready_agent(fleet, operator, tmp_path)
    results = await Results().start(bus, prefix)
    await deployed(bus, prefix, operator, results, placed=True)
    drain = await send(bus, prefix, operator, Drain(deadline=1.0))
    final = await results.final(drain.id)
    assert "1 placed workloads not moved by the deadline" in final.detail
    await send(bus, prefix, operator, Stop(name="chat"))
    await wait_record(
        bus, prefix, "n1", lambda r: r.heartbeat is not None and not r.heartbeat.workloads
    )
    uncordon = await send(bus, prefix, operator, Uncordon())
    assert (await results.final(uncordon.id)).status == "done"
    await deployed(bus, prefix, operator, results, placed=False)
    again = await send(bus, prefix, operator, Drain(deadline=30))
    final = await results.final(again.id)
    assert final.status == "done" and final.detail.startswith("drained"), final.detail
    assert "placed" not in final.detail

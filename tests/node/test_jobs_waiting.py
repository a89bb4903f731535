"""``jobs.waiting`` in the heartbeat is the sum of the engines' waiting counts (it was
always 0), next to ``jobs.running``."""

from __future__ import annotations

from nats.aio.msg import Msg

from schemas import codec
from schemas.messages import Heartbeat
from schemas.subjects import Subjects
from tests.node.test_engine import VLLM_METRICS
from tests.support.fake_http import text
from tests.support.fleet import Fleet, wait_for


async def test_heartbeat_jobs_waiting_sums_the_engines_waiting(fleet: Fleet) -> None:
    """vLLM reports 5 running and 4 waiting: the heartbeat says running 5, waiting 4."""
    url = await fleet.serve({"/health": text(""), "/metrics": text(VLLM_METRICS)})
    await fleet.start_aggregator()
    beats: list[Heartbeat] = []

    async def collect(msg: Msg) -> None:
        beats.append(codec.decode(msg.data, Heartbeat, msg.subject))

    subscription = await fleet.bus.nc.subscribe(
        Subjects(fleet.prefix).heartbeat("c1", "n1"), cb=collect
    )
    fleet.stack.push_async_callback(subscription.unsubscribe)
    await fleet.bus.flush()
    # No drain on the way out: the stand-in never finishes its 5 requests.
    config = fleet.config(engines=[f"vllm={url}"], engine_interval=0.3, shutdown_drain=False)
    await fleet.start_agent(config)

    def jobs_known() -> bool:
        return any(beat.jobs is not None and beat.jobs.running for beat in beats)

    await wait_for(jobs_known)
    jobs = next(beat.jobs for beat in beats if beat.jobs is not None and beat.jobs.running)
    assert jobs is not None and (jobs.running, jobs.waiting) == (5, 4)

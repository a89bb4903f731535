"""Fleet settings on running agents: taken live by cluster and by selector, refused with
a reason, waiting for a restart, and measured where they act (heartbeat spacing, the
health verdict)."""

from __future__ import annotations

import asyncio
import itertools
import statistics
from collections.abc import Callable

import msgspec

from actors.node.config import ENV_PREFIX, AgentConfig
from actors.node.settings.table import NOT_SETTABLE, PINNED
from actors.runtime.bus import NatsBus
from actors.runtime.config import layers
from schemas import codec
from schemas.events import Inject
from schemas.messages import Heartbeat
from schemas.settings import FLEET_KEY, SettingsStatus, cluster_key, selector_key
from schemas.signing import KeyPair
from schemas.subjects import EVENT_INJECT, Subjects
from tests.support.fleet import Fleet, approved_agent
from tests.support.settings import put_settings, wait_settings

FAST = {"settings_interval": 0.2, "heartbeat_interval": 0.5, "stale_after": 3.0}
"""Agents that read the fleet's settings five times a second."""
POOL = {"pool": "inference"}


def trusting(fleet: Fleet, node: str, operator: KeyPair, **settings: object) -> AgentConfig:
    return fleet.config(node, trust_operators=[operator.public_key], **FAST, **settings)


def applying(keys: set[str]) -> Callable[[SettingsStatus, Heartbeat], bool]:
    """A wait_settings check: the node applies exactly ``keys``."""
    return lambda status, _: set(status.applied) == keys


async def beat_gaps(bus: NatsBus, prefix: str, node: str, beats: int) -> list[float]:
    """Seconds between ``beats`` consecutive heartbeats of ``node`` as they went out (their
    ``ts``), taken from the wire."""
    stamps: list[float] = []
    done = asyncio.Event()

    async def on_beat(msg: object) -> None:
        stamps.append(codec.decode(msg.data, Heartbeat).ts)  # type: ignore[attr-defined]
        if len(stamps) > beats:
            done.set()

    subscription = await bus.subscribe(Subjects(prefix).heartbeat("c1", node), on_beat)
    try:
        async with asyncio.timeout(30):
            await done.wait()
    finally:
        await subscription.unsubscribe()
    return [later - earlier for earlier, later in itertools.pairwise(stamps)]


async def test_cluster_and_selector_settings_reach_three_agents_live(fleet: Fleet) -> None:
    """A cluster's heartbeat_interval and a selector's GPU temperature limit reach the
    agents they name while they run: the heartbeats' spacing changes on the cluster's two
    nodes only, and the two selected nodes turn degraded at a temperature the others
    still call fine; each heartbeat names the entry every value came from."""
    await fleet.start_aggregator()
    operator = KeyPair.generate()
    configs = {
        "n1": trusting(fleet, "n1", operator),
        "n2": trusting(fleet, "n2", operator, labels=POOL),
        "n3": trusting(fleet, "n3", operator, cluster="c2", labels=POOL),
    }
    for config in configs.values():
        await fleet.start_agent(config)
    for node in configs:  # 70 C: under the default limit of 85 C
        inject = Inject(ts=0.0, node_id=node, fault="temp", value=70.0)
        await fleet.publish_event(EVENT_INJECT, inject, node)
    before = statistics.median(await beat_gaps(fleet.bus, fleet.prefix, "n1", 6))

    await put_settings(
        fleet.bus, fleet.prefix, operator, {"heartbeat_interval": "2s"}, cluster="c1"
    )
    await put_settings(
        fleet.bus, fleet.prefix, operator, {"gpu_thresholds.temperature": "65"}, selector=POOL
    )

    applied = {
        "n1": {"heartbeat_interval"},
        "n2": {"heartbeat_interval", "gpu_thresholds.temperature"},
        "n3": {"gpu_thresholds.temperature"},
    }
    for node, wanted in applied.items():
        beat = await wait_settings(fleet.bus, fleet.prefix, node, applying(wanted))
        assert beat.settings is not None
        sources = beat.settings.applied
        assert sources.get("heartbeat_interval", cluster_key("c1")) == cluster_key("c1")
        assert sources.get("gpu_thresholds.temperature", selector_key(POOL)) == selector_key(POOL)
        assert beat.interval == (2.0 if "heartbeat_interval" in wanted else 0.5)

    for node in ("n2", "n3"):
        beat = await wait_settings(
            fleet.bus,
            fleet.prefix,
            node,
            lambda _, beat: beat.health is not None and beat.health.status == "degraded",
        )
        assert beat.health is not None
        nvml = next(check for check in beat.health.checks if check.name == "nvml")
        assert nvml.status == "degraded" and "(> 65 C)" in nvml.reason
    n1 = await wait_settings(fleet.bus, fleet.prefix, "n1", lambda _, beat: beat.health is not None)
    assert n1.health is not None and n1.health.status == "healthy"

    after = statistics.median(await beat_gaps(fleet.bus, fleet.prefix, "n1", 3))
    print(f"n1 heartbeat spacing: {before:.2f}s before, {after:.2f}s after heartbeat_interval=2s")
    assert before < 0.8 and 1.6 < after < 2.4


async def test_refused_values_and_probe_targets_in_the_heartbeat(fleet: Fleet) -> None:
    """The heartbeat lists each key the node refuses with why (a value its config
    refuses, settings the fleet may not set, one its own flag sets) beside those it
    applied; a new probe target is probed at the next round (the peer it names shows in
    the heartbeat's latency)."""
    await fleet.start_aggregator()
    operator = KeyPair.generate()
    config = trusting(fleet, "n1", operator, probe_interval=0.3)
    flags = {"health_interval": "0.5"}
    given = layers(AgentConfig, ENV_PREFIX, env={}, flags=flags, base=msgspec.to_builtins(config))
    agent = await approved_agent(fleet.bus, config, given)
    fleet.stack.push_async_callback(agent.stop)
    values = {
        "engine_timeout": "never",
        "server": "nats://elsewhere:4222",
        "engines": "vllm=http://169.254.169.254",
        "health_interval": "1s",
        "peers": "n9",
    }
    await put_settings(fleet.bus, fleet.prefix, operator, values)
    beat = await wait_settings(fleet.bus, fleet.prefix, "n1", lambda s, _: bool(s.refused))
    assert beat.settings is not None
    assert beat.settings.refused == {
        "engine_timeout": "engine_timeout: 'never' is not a duration (use 30, 30s, 500ms, 2m, 1h)",
        "engines": NOT_SETTABLE,
        "health_interval": PINNED,
        "server": NOT_SETTABLE,
    }
    assert beat.settings.applied == {"peers": FLEET_KEY}
    probed = await wait_settings(
        fleet.bus,
        fleet.prefix,
        "n1",
        lambda _, beat: beat.latency is not None and len(beat.latency.peers) == 1,
    )
    assert probed.latency is not None
    assert [peer.target_node_id for peer in probed.latency.peers] == ["n9"]
    assert probed.engine is None or probed.engine.engines == []
    assert agent.metrics.value("node_agent_settings_refused") == 4


async def test_a_setting_read_at_start_is_applied_at_the_next_start(fleet: Fleet) -> None:
    """shutdown_timeout, read once at start, is reported as waiting while the agent runs
    (which keeps its own); restarted, the agent starts with it and its first heartbeats
    report it applied."""
    await fleet.start_aggregator()
    operator = KeyPair.generate()
    config = trusting(fleet, "n1", operator)
    agent = await fleet.start_agent(config)
    entry = await put_settings(fleet.bus, fleet.prefix, operator, {"shutdown_timeout": "7s"})
    await wait_settings(
        fleet.bus, fleet.prefix, "n1", lambda s, _: s.restart == ["shutdown_timeout"]
    )
    assert agent.config.shutdown_timeout == 2.0
    await agent.stop()
    again = await fleet.start_agent(config)
    assert again.config.shutdown_timeout == 7.0 and again.heartbeat is not None
    boot = again.heartbeat.boot_id
    beat = await wait_settings(fleet.bus, fleet.prefix, "n1", lambda _, beat: beat.boot_id == boot)
    assert beat.settings is not None and beat.settings.revision == entry.revision
    assert beat.settings.applied == {"shutdown_timeout": FLEET_KEY}
    assert beat.settings.restart == []


async def test_a_selector_on_the_nodes_own_gpu_labels_needs_no_hand_written_label(
    fleet: Fleet,
) -> None:
    """A selector on gpu.count, a label the agent sets itself from its GPUs, reaches the
    node with two GPUs and not the one with one, though neither file has a label (the
    one-GPU node's read that takes a later fleet entry saw the selector's too)."""
    await fleet.start_aggregator()
    operator = KeyPair.generate()
    await fleet.start_agent(trusting(fleet, "n1", operator, fake_gpus=2))
    await fleet.start_agent(trusting(fleet, "n2", operator, fake_gpus=1))
    two_gpus = {"gpu.count": "2"}
    await put_settings(
        fleet.bus, fleet.prefix, operator, {"sample_interval": "2s"}, selector=two_gpus
    )
    await put_settings(fleet.bus, fleet.prefix, operator, {"probe_interval": "4s"})

    both = {"sample_interval", "probe_interval"}
    n1 = await wait_settings(fleet.bus, fleet.prefix, "n1", applying(both))
    assert n1.labels.get("gpu.count") == "2"
    assert n1.settings is not None
    assert n1.settings.applied["sample_interval"] == selector_key(two_gpus)
    n2 = await wait_settings(fleet.bus, fleet.prefix, "n2", applying({"probe_interval"}))
    assert n2.labels["gpu.count"] == "1"
    assert n2.settings is not None and n2.settings.applied == {"probe_interval": FLEET_KEY}

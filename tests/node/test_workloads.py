"""The workload actor against real processes: the llama.cpp stand-in started through the
llama.cpp launch template, deployed and stopped by signed commands to a real agent."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from nats.aio.msg import Msg

from actors.node.agent import NodeAgent
from actors.node.workloads import actor as workloads_actor
from actors.node.workloads import listeners, processes
from actors.node.workloads.readiness import readiness
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Workload, Workloads
from schemas.messages import Cordon, Deregister, Drain, Heartbeat
from schemas.subjects import EVENT_WORKLOAD_ORDER, EVENT_WORKLOADS, Subjects
from schemas.workloads import Deploy, Stop, WorkloadOrder
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, wait_for
from tests.support.tiny_gguf import write_tiny_llama
from tests.support.workloads import killing_leftovers, standin_script

STANDIN_FLAGS = ("--load-time", "--crash-after", "--hang", "--spawn-child", "--chunk-delay")
"""The stand-in's test switches, added to the llama.cpp allow-list as a node would."""


@pytest.fixture
def operator() -> signing.KeyPair:
    return signing.KeyPair.generate()


@pytest.fixture
async def results(bus: NatsBus, prefix: str) -> Results:
    return await Results().start(bus, prefix)


@pytest.fixture
def standin(tmp_path: Path) -> Path:
    """An executable ``llama-server`` that runs the stand-in, for the llama.cpp template."""
    return standin_script(tmp_path / "bin")


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    """Kill what a test's agents left running (agents leave workloads for the next agent)."""
    with killing_leftovers():
        yield


class Watch:
    """Every Workloads event and heartbeat node n1 publishes."""

    def __init__(self) -> None:
        self.events: list[Workloads] = []
        self.beats: list[Heartbeat] = []

    async def start(self, bus: NatsBus, prefix: str) -> Watch:
        subjects = Subjects(prefix)
        await bus.subscribe(subjects.event("n1", EVENT_WORKLOADS), self._on_event)
        await bus.subscribe(subjects.heartbeat("c1", "n1"), self._on_beat)
        await bus.flush()
        return self

    async def _on_event(self, msg: Msg) -> None:
        self.events.append(codec.decode(msg.data, Workloads, msg.subject))

    async def _on_beat(self, msg: Msg) -> None:
        self.beats.append(codec.decode(msg.data, Heartbeat, msg.subject))

    def latest(self, name: str) -> Workload | None:
        """``name`` as the newest event lists it (None when it does not)."""
        if not self.events:
            return None
        return next((w for w in self.events[-1].workloads if w.name == name), None)

    async def state(self, name: str, state: str, timeout: float = 15.0) -> Workload:
        def check() -> Workload | None:
            workload = self.latest(name)
            return workload if workload is not None and workload.state == state else None

        found: Workload = await wait_for(check, timeout)
        return found


@pytest.fixture
async def watch(bus: NatsBus, prefix: str) -> Watch:
    return await Watch().start(bus, prefix)


async def agent(
    fleet: Fleet, operator: signing.KeyPair, standin: Path, **settings: Any
) -> NodeAgent:
    values: dict[str, Any] = dict(
        trust_operators=[operator.public_key],
        workload_binaries=[f"llamacpp={standin}"],
        workload_args=[f"llamacpp={flag}" for flag in STANDIN_FLAGS],
        workload_stop_grace=2.0,
        workload_backoff_max=0.2,
        engine_interval=0.3,
    )
    values.update(settings)
    started = await fleet.start_agent(fleet.config(**values))
    assert started.supervisor is not None and await started.supervisor.wait_ready(10)
    return started


def chat(*args: str, **kw: Any) -> Deploy:
    values: dict[str, Any] = dict(
        name="chat", engine="llamacpp", model="/models/x.gguf", gpus=[1], ready_timeout=15.0
    )
    values["args"] = list(args)
    values.update(kw)
    return Deploy(**values)


def pid_of(watch_dir: Path) -> int:
    saved = codec.decode((watch_dir / "workloads.json").read_bytes(), dict[str, Any])
    return int(saved["workloads"][0]["pid"])


async def test_deploy_goes_ready_pinned_reported_and_probed(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """A deploy answers accepted, in_progress (starting, loading) and done ready; the child
    has CUDA_VISIBLE_DEVICES of its GPUs and NCCL/Gloo bound to loopback; heartbeats list it
    and the engine probe covers it."""
    await agent(fleet, operator, standin)
    command = await send(bus, prefix, operator, chat("--load-time", "1.5"))
    final = await results.final(command.id)
    assert final.status == "done" and "ready on 127.0.0.1:" in final.detail, final.detail
    details = [r.detail for r in results.of(command.id) if r.status == "in_progress"]
    assert results.statuses(command.id)[0] == "accepted"
    assert any(d.startswith("starting") for d in details)
    assert any(d.startswith("loading") for d in details), details
    workload = await watch.state("chat", "ready")
    pid = pid_of(Path(fleet.config().state_dir))
    environ = psutil.Process(pid).environ()
    assert environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert environ["NCCL_SOCKET_IFNAME"] == environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert psutil.Process(pid).cmdline()[-2:] == ["--load-time", "1.5"]
    url = f"http://127.0.0.1:{workload.port}"

    def beat_shows_it() -> bool:
        for beat in watch.beats:
            listed = [w for w in beat.workloads if w.name == "chat" and w.state == "ready"]
            probed = beat.engine is not None and any(
                e.url == url and e.healthy for e in beat.engine.engines
            )
            if listed and listed[0].gpus == [1] and probed:
                return True
        return False

    await wait_for(beat_shows_it)


async def test_ready_timeout_fails_with_the_log_tail(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """A workload that never gets ready is failed after its ready timeout, its log tail in
    the result, and its process is gone."""
    await agent(fleet, operator, standin)
    command = await send(bus, prefix, operator, chat("--hang", ready_timeout=3.0))
    final = await results.final(command.id)
    assert final.status == "failed"
    # The log's first line (written by the agent) says what was started, so the tail is
    # there even when a loaded machine starts the stand-in slowly.
    assert "not ready within 3s; log: " in final.detail and "llama-server" in final.detail
    assert (await watch.state("chat", "failed")).reason.startswith("not ready")
    pid = pid_of(Path(fleet.config().state_dir))
    assert not processes.alive(pid, processes.started_at(pid) or 1.0)


async def test_readiness_is_probed_every_workload_ready_interval(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """workload_ready_interval 1s: a workload that never gets ready within its 3 s is
    probed at most four times (at the 0.25 s default, a dozen), at least once."""
    probes: list[int] = []

    async def counted(session: aiohttp.ClientSession, port: int, model: str) -> str:
        probes.append(port)
        return await readiness(session, port, model)

    monkeypatch.setattr(workloads_actor, "readiness", counted)
    await agent(fleet, operator, standin, workload_ready_interval=1.0)
    command = await send(bus, prefix, operator, chat("--hang", ready_timeout=3.0))
    final = await results.final(command.id, timeout=20)
    assert final.status == "failed" and "not ready within 3s" in final.detail
    assert 1 <= len(probes) <= 4, probes


async def test_a_crash_is_restarted(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """A ready workload that exits is started again and becomes ready again."""
    await agent(fleet, operator, standin)
    command = await send(bus, prefix, operator, chat("--crash-after", "1.5", "--load-time", "0"))
    assert (await results.final(command.id)).status == "done"
    first = pid_of(Path(fleet.config().state_dir))

    def restarted() -> Workload | None:
        workload = watch.latest("chat")
        ok = workload is not None and workload.restarts >= 1 and workload.state == "ready"
        return workload if ok else None

    assert (await wait_for(restarted, 20)).restarts >= 1
    assert pid_of(Path(fleet.config().state_dir)) != first


async def test_a_restart_whose_port_was_taken_moves_to_a_free_one(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A crashed workload whose port (chosen by the agent) another process took while
    it was down restarts on a free port and is ready there, not crash-looping on the
    taken one (as one did in CI: 5 crashes, 'address already in use')."""
    await agent(fleet, operator, standin)
    command = await send(bus, prefix, operator, chat("--crash-after", "1.5", "--load-time", "0"))
    assert (await results.final(command.id)).status == "done"
    first = watch.latest("chat")
    assert first is not None and first.port
    taken = first.port
    in_use = processes.port_in_use
    monkeypatch.setattr(processes, "port_in_use", lambda port: port == taken or in_use(port))

    def moved() -> Workload | None:
        workload = watch.latest("chat")
        ok = workload is not None and workload.restarts >= 1 and workload.state == "ready"
        return workload if ok and workload is not None and workload.port != taken else None

    assert (await wait_for(moved)).port != taken


async def test_a_crash_loop_gives_up(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """A workload that keeps exiting is left in crashloop after the crash limit, and its
    deploy fails saying so."""
    await agent(fleet, operator, standin, workload_crash_limit=3)
    command = await send(bus, prefix, operator, chat("--crash-after", "0.05"))
    final = await results.final(command.id)
    assert final.status == "failed" and final.detail.startswith("crashloop: 3 crashes")
    workload = await watch.state("chat", "crashloop")
    assert workload.restarts == 2


async def test_stop_kills_the_whole_process_group(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """Stop ends the workload and every process in its group (its children too)."""
    await agent(fleet, operator, standin)
    deploy = await send(bus, prefix, operator, chat("--spawn-child"))
    assert (await results.final(deploy.id)).status == "done"
    pid = pid_of(Path(fleet.config().state_dir))
    group = await wait_for(
        lambda: (lambda g: g if len(g) >= 2 else None)(processes.group_pids(pid))
    )
    stop = await send(bus, prefix, operator, Stop(name="chat"))
    final = await results.final(stop.id)
    assert final.status == "done" and final.detail == "stopped"
    assert processes.group_pids(pid) == []
    for member in group:
        assert not psutil.pid_exists(member) or psutil.Process(member).status() == "zombie"
    await wait_for(lambda: watch.events and watch.latest("chat") is None)


async def test_agent_restart_adopts_a_live_workload(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """A new agent finds the workload the old one started (same pid, no restart) and
    reports it ready."""
    first = await agent(fleet, operator, standin)
    deploy = await send(bus, prefix, operator, chat())
    assert (await results.final(deploy.id)).status == "done"
    pid = pid_of(Path(fleet.config().state_dir))
    await first.stop()
    assert processes.alive(pid, processes.started_at(pid))
    watch.events.clear()
    await agent(fleet, operator, standin)
    workload = await watch.state("chat", "ready")
    assert workload.restarts == 0
    assert pid_of(Path(fleet.config().state_dir)) == pid
    assert processes.alive(pid, processes.started_at(pid))


@pytest.mark.parametrize(
    ("deploy", "settings", "reason"),
    [
        (chat(engine="process", args=["sleep", "60"], model=""), {}, "engine process not allowed"),
        (
            chat(engine="process", args=["sleep", "60"], model=""),
            {"workload_engines": ["process"], "workload_binaries": ["true"]},
            "executable sleep not in this node's workload_binaries",
        ),
        (chat(gpus=[5]), {}, "no GPU 5 on this node"),
        (chat(env={"LD_PRELOAD": "/tmp/x.so"}), {}, "environment LD_PRELOAD may not be set"),
        (chat("--hos=0.0.0.0"), {}, "argument --hos may not be given to llamacpp"),
    ],
    ids=["engine", "binary", "gpu", "env", "prefix"],
)
async def test_deploy_refused_by_the_node_config(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    deploy: Deploy,
    settings: dict[str, Any],
    reason: str,
) -> None:
    """A deploy the node does not allow is rejected with the reason and starts nothing."""
    await agent(fleet, operator, standin, **settings)
    command = await send(bus, prefix, operator, deploy)
    final = await results.final(command.id)
    assert final.status == "rejected" and reason in final.detail, final.detail
    assert not (Path(fleet.config().state_dir) / "workloads.json").exists()


async def test_deploy_refused_on_a_cordoned_node(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
) -> None:
    """A cordoned node refuses a deploy with the reason."""
    await agent(fleet, operator, standin)
    cordon = await send(bus, prefix, operator, Cordon())
    assert (await results.final(cordon.id)).status == "done"
    command = await send(bus, prefix, operator, chat())
    final = await results.final(command.id)
    assert final.status == "rejected" and "node is cordoned" in final.detail


async def test_gpu_shared_only_when_asked(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
) -> None:
    """A second workload on a GPU in use is refused, and the same name twice too."""
    await agent(fleet, operator, standin)
    first = await send(bus, prefix, operator, chat())
    assert (await results.final(first.id)).status == "done"
    other = await send(bus, prefix, operator, chat(name="other"))
    final = await results.final(other.id)
    assert final.status == "rejected" and "GPU 1 already used by workload chat" in final.detail
    again = await send(bus, prefix, operator, chat(gpus=[0]))
    final = await results.final(again.id)
    assert final.status == "rejected" and "already runs" in final.detail


@pytest.mark.parametrize("signer", ["operator", "none", "node"])
async def test_a_workload_order_not_signed_by_the_node_is_dropped(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    signer: str,
) -> None:
    """A workload_order event that the node's process did not publish (even one signed by
    a trusted operator, who must go through a command, or by the node's key from outside
    the process) starts nothing and answers nothing."""
    started = await agent(fleet, operator, standin)
    order = WorkloadOrder(ts=time.time(), command_id="forged", action=chat())
    body = codec.encode(order)
    keys = {"operator": operator, "node": fleet.node_key()}
    headers = keys[signer].headers(body) if signer in keys else {}
    await bus.publish(Subjects(prefix).event("n1", EVENT_WORKLOAD_ORDER), body, headers=headers)
    await bus.flush()
    reason = {"operator": "untrusted_key", "node": "no_session"}.get(signer, "unsigned")

    def dropped() -> float:
        return sum(
            sample.value
            for metric in started.metrics.events_dropped.collect()
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels["reason"] == reason
        )

    await wait_for(lambda: dropped() >= 1)
    assert results.of("forged") == []
    assert not (Path(fleet.config().state_dir) / "workloads.json").exists()


@pytest.mark.slow
async def test_a_drain_waits_for_a_workloads_in_flight_request(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """The engine probe counts a ready workload's requests (no engine configured), so a
    drain reports them in flight and ends drained once the stream has finished."""
    await agent(fleet, operator, standin)
    deploy = await send(bus, prefix, operator, chat("--chunk-delay", "0.8"))
    final = await results.final(deploy.id)
    port = final.detail.split(":")[-1].split()[0]
    async with aiohttp.ClientSession() as session:
        body = {"model": "/models/x.gguf", "stream": True, "messages": []}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with session.post(url, json=body) as response:
            # Once a heartbeat shows the probe counted it, the drain must wait for it.
            await wait_for(
                lambda: any(b.engine and b.engine.in_flight == 1 for b in watch.beats[-3:])
            )
            drain = await send(bus, prefix, operator, Drain(deadline=30))
            await wait_for(lambda: any(r.in_flight == 1 for r in results.of(drain.id)))
            chunks = [line async for line in response.content if line.startswith(b"data:")]
    assert chunks[-1].strip() == b"data: [DONE]"
    drained = await results.final(drain.id)
    assert drained.status == "done" and drained.detail.startswith("drained"), drained.detail


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("llama-server") is None, reason="llama-server not on PATH")
async def test_a_real_llama_server_goes_ready_and_stops(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    tmp_path: Path,
    results: Results,
) -> None:
    """llama.cpp's own server, from the llama.cpp template with a tiny random GGUF model,
    goes ready (its /health and /v1/models) and stops with its whole process group."""
    pytest.importorskip("gguf", reason="the gguf package writes the test model")
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    started = await fleet.start_agent(
        fleet.config(trust_operators=[operator.public_key], workload_stop_grace=5.0)
    )
    assert started.supervisor is not None and await started.supervisor.wait_ready(10)
    deploy = Deploy(name="real", engine="llamacpp", model=str(model), ready_timeout=120.0)
    command = await send(bus, prefix, operator, deploy)
    final = await results.final(command.id, timeout=150)
    assert final.status == "done" and final.detail.startswith("ready on 127.0.0.1:"), final.detail
    pid = pid_of(Path(fleet.config().state_dir))
    stop = await send(bus, prefix, operator, Stop(name="real"))
    assert (await results.final(stop.id)).status == "done"
    assert processes.group_pids(pid) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
async def test_a_workload_listening_beyond_loopback_is_stopped_and_reported(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
    host: str,
) -> None:
    """A workload whose own argv binds it to every address (a process deploy may) is found
    from its sockets in /proc once it answers, stopped, and the deploy fails saying where
    it listened."""
    settings = {"workload_engines": ["process"], "workload_binaries": [str(standin)]}
    await agent(fleet, operator, standin, **settings)
    argv = [str(standin), "--host", host, "--port", "{port}", "-m", "/models/x.gguf"]
    deploy = chat(engine="process", args=argv, model="", gpus=[])
    command = await send(bus, prefix, operator, deploy)
    final = await results.final(command.id)
    assert final.status == "failed", final.detail
    workload = await watch.state("chat", "failed")
    shown = f"[{host}]" if ":" in host else host
    assert f"listening on {shown}:{workload.port}, beyond 127.0.0.1" in final.detail
    assert workload.reason.startswith("stopped: listening on")
    pid = pid_of(Path(fleet.config().state_dir))
    assert not processes.group_pids(pid)


async def test_a_workload_on_loopback_passes_the_listening_check(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
) -> None:
    """The same process deploy bound to 127.0.0.1 is ready, and /proc shows it listening
    there only."""
    settings = {"workload_engines": ["process"], "workload_binaries": [str(standin)]}
    await agent(fleet, operator, standin, **settings)
    argv = [str(standin), "--host", "127.0.0.1", "--port", "{port}", "-m", "/models/x.gguf"]
    command = await send(
        bus, prefix, operator, chat(engine="process", args=argv, model="", gpus=[])
    )
    final = await results.final(command.id)
    assert final.status == "done", final.detail
    pid = pid_of(Path(fleet.config().state_dir))
    port = int(final.detail.rsplit(":", 1)[1])
    assert listeners.listening(pid) == [("127.0.0.1", port)]
    assert listeners.strays(pid) == []


@pytest.mark.slow
async def test_deregistering_ends_every_workload_before_the_agent_exits(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """Deregister: the workload's whole process group is ended before the agent finishes
    (its GPUs free, nothing saved for a next agent to adopt)."""
    started = await agent(fleet, operator, standin)
    deploy = await send(bus, prefix, operator, chat("--spawn-child"))
    assert (await results.final(deploy.id)).status == "done"
    state_dir = Path(fleet.config().state_dir)
    pid = pid_of(state_dir)
    group = await wait_for(
        lambda: (lambda g: g if len(g) >= 2 else None)(processes.group_pids(pid))
    )
    leave = await send(bus, prefix, operator, Deregister(deadline=0.5))
    final = await results.final(leave.id)
    assert (final.status, final.detail) == ("done", "deregistered")
    # The agent was told it is finished only once a beat showed no workload left.
    assert processes.group_pids(pid) == []
    for member in group:
        assert not psutil.pid_exists(member) or psutil.Process(member).status() == "zombie"
    assert any(b.deregistering and not b.workloads for b in watch.beats)
    assert (
        codec.decode((state_dir / "workloads.json").read_bytes(), dict[str, Any])["workloads"] == []
    )
    assert started.supervisor is not None
    await asyncio.wait_for(started.supervisor.finished.wait(), 5)


async def test_another_model_switches_an_idle_gpu_after_its_requests(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    standin: Path,
    results: Results,
    watch: Watch,
) -> None:
    """A deploy of another model onto a GPU whose workload is ready switches it: the
    stream the gateway holds of the old one finishes, the old one is stopped, the new one
    goes through loading to ready and the gateway serves it; the same model is refused."""
    started = await agent(fleet, operator, standin, gateway="on", gateway_port=0)
    first = await send(bus, prefix, operator, chat("--chunk-delay", "0.4"))
    assert (await results.final(first.id)).status == "done"
    await watch.state("chat", "ready")
    old_pid = pid_of(Path(started.config.state_dir))
    gateway_port = int((Path(started.config.state_dir) / "gateway.port").read_text())
    url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        body = {"model": "/models/x.gguf", "stream": True, "messages": []}
        async with session.post(url, json=body) as response:
            assert response.status == 200
            switch = await send(
                bus,
                prefix,
                operator,
                chat("--load-time", "1", name="chat2", model="/models/y.gguf"),
            )
            chunks = [line async for line in response.content if line.startswith(b"data:")]
    assert chunks[-1].strip() == b"data: [DONE]"
    final = await results.final(switch.id)
    assert final.status == "done" and "ready" in final.detail, final.detail
    details = [r.detail for r in results.of(switch.id)]
    assert any("switching" in d and "takes no new requests" in d for d in details)
    assert any(d.startswith("loading") for d in details), details
    assert watch.latest("chat") is None and not psutil.pid_exists(old_pid)
    new = await watch.state("chat2", "ready")
    assert new.model == "/models/y.gguf" and new.gpus == [1]
    async with aiohttp.ClientSession() as session:
        body = {"model": "/models/y.gguf", "messages": []}
        async with session.post(url, json=body) as response:
            assert response.status == 200
    same = await send(bus, prefix, operator, chat(name="chat3", model="/models/y.gguf"))
    refused = await results.final(same.id)
    assert refused.status == "rejected" and "GPU 1 already used by workload chat2" in refused.detail

"""Container workloads: the ``podman run`` a deploy with an image becomes, the node's image
allow-list, a whole deploy (pull with progress, ready, container id in the heartbeat,
stop) through a podman stand-in, and the same with the real podman and an image built
here FROM scratch, skipped with the reason printed where podman cannot run containers."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from actors.node.agent import NodeAgent
from actors.node.config import AgentConfig
from actors.node.workloads import container
from actors.node.workloads.launch import NotAllowed, command_line
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Heartbeat
from schemas.subjects import Subjects
from schemas.workloads import Deploy, Stop
from tests.support.commanding import Results, send
from tests.support.fake_podman import CONTAINER_ID
from tests.support.fleet import Fleet, wait_for
from tests.support.workloads import fake_podman_script, killing_leftovers

SUPPORT = Path(__file__).resolve().parents[1] / "support" / "container"
IMAGE = "registry.example/llama"
TEST_IMAGE = "localhost/node-agent-test-tiny:latest"


def config(**settings: Any) -> AgentConfig:
    values: dict[str, Any] = {
        "node_id": "n1",
        "workload_engines": ["llamacpp", "process"],
        "workload_images": [IMAGE, "registry.example/tools:1.0"],
    }
    return AgentConfig(**(values | settings))


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    with killing_leftovers():
        yield


def test_only_listed_images_run() -> None:
    """A listed repository allows its tags and digests; a listed tag only itself; a
    look-alike repository or another tag is refused with the reason."""
    node = config()
    assert container.allowed_image(node, IMAGE + ":b4500")
    assert container.allowed_image(node, IMAGE + "@sha256:" + "0" * 64)
    assert container.allowed_image(node, "registry.example/tools:1.0")
    for image in (IMAGE + "-evil:1", "registry.example/tools:2.0", "docker.io/library/x"):
        assert not container.allowed_image(node, image), image
    deploy = Deploy(name="w", engine="process", image="docker.io/library/x", args=["sh"])
    with pytest.raises(NotAllowed, match="not in this node's workload_images"):
        command_line(node, deploy, 9000)


def test_engine_in_an_image_listens_in_its_own_namespace() -> None:
    """Inside a container the engine's own binary listens on 0.0.0.0 of the container's
    namespace; the allow-lists still apply; a process deploy's argv is the command."""
    node = config(workload_binaries=["llamacpp=/host/llama-server"])
    image = IMAGE + ":1"
    deploy = Deploy(name="w", engine="llamacpp", model="/m/x", image=image, args=["-c", "4096"])
    argv = command_line(node, deploy, 9000)
    assert argv == [
        "llama-server", "--host", "0.0.0.0", "--port", "9000", "-m", "/m/x", "-c", "4096"
    ]  # fmt: skip
    host = Deploy(name="w", engine="llamacpp", model="m", image=image, args=["--host=1"])
    with pytest.raises(NotAllowed, match="--host"):
        command_line(node, host, 1)
    process = Deploy(name="w", engine="process", image=IMAGE, args=["/srv", "{port}"])
    assert command_line(node, process, 9001) == ["/srv", "9001"]
    assert command_line(node, Deploy(name="w", engine="process", image=IMAGE), 1) == []


def test_podman_run_publishes_on_loopback_and_passes_gpus(tmp_path: Path) -> None:
    """The port is published on 127.0.0.1 only, capabilities dropped; GPUs by CDI device
    where a spec is installed, else by NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES."""
    node = config()
    deploy = Deploy(name="w", engine="process", image=IMAGE, gpus=[1, 3])
    cid = tmp_path / "w.cid"
    argv = container.run_argv(node, deploy, 9000, ["/srv"], cid, {"OMP_NUM_THREADS": "4"}, True)
    assert argv[:2] == ["podman", "run"] and argv[-2:] == [IMAGE, "/srv"]
    pairs = list(itertools.pairwise(argv))
    assert ("--publish", "127.0.0.1:9000:9000") in pairs and ("--cap-drop", "all") in pairs
    assert ("--security-opt", "no-new-privileges") in pairs and ("--cidfile", str(cid)) in pairs
    assert ("--device", "nvidia.com/gpu=1") in pairs and ("--device", "nvidia.com/gpu=3") in pairs
    assert ("--env", "PORT=9000") in pairs and ("--env", "OMP_NUM_THREADS=4") in pairs
    assert not any("VISIBLE_DEVICES" in arg for arg in argv)
    plain = container.run_argv(node, deploy, 9000, [], cid, {}, False)
    assert "--device" not in plain and plain[-1] == IMAGE
    assert "NVIDIA_VISIBLE_DEVICES=1,3" in plain and "CUDA_VISIBLE_DEVICES=1,3" in plain
    specs = tmp_path / "cdi"
    specs.mkdir()
    assert not container.cdi_available((specs, tmp_path / "missing"))
    (specs / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    assert container.cdi_available((specs,))


class Beats:
    """Node n1's heartbeats."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []

    async def start(self, bus: NatsBus, prefix: str) -> Beats:
        async def on_beat(msg: Any) -> None:
            self.beats.append(codec.decode(msg.data, Heartbeat, msg.subject))

        await bus.subscribe(Subjects(prefix).heartbeat("c1", "n1"), on_beat)
        await bus.flush()
        return self


async def agent(fleet: Fleet, operator: signing.KeyPair, **settings: Any) -> NodeAgent:
    values: dict[str, Any] = dict(
        trust_operators=[operator.public_key],
        workload_engines=["llamacpp", "process"],
        workload_stop_grace=2.0,
        workload_backoff_max=0.2,
    )
    started = await fleet.start_agent(fleet.config(**(values | settings)))
    assert started.supervisor is not None and await started.supervisor.wait_ready(10)
    return started


async def test_a_container_workload_pulls_starts_reports_and_stops(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Through the podman stand-in: the missing image is pulled with podman's progress
    lines as results, the engine inside goes ready, the heartbeat carries its container
    id, and a stop ends it and removes the container."""
    operator = signing.KeyPair.generate()
    results = await Results().start(bus, prefix)
    beats = await Beats().start(bus, prefix)
    state = tmp_path / "podman-state"
    podman = fake_podman_script(tmp_path / "bin", state)
    await agent(fleet, operator, workload_podman=str(podman), workload_images=[IMAGE])
    deploy = Deploy(
        name="boxed", engine="llamacpp", model="/m/x.gguf", gpus=[1], image=IMAGE + ":1",
        ready_timeout=15.0,
    )  # fmt: skip
    command = await send(bus, prefix, operator, deploy)
    final = await results.final(command.id)
    assert final.status == "done" and "ready on 127.0.0.1:" in final.detail, final.detail
    details = [r.detail for r in results.of(command.id) if r.status == "in_progress"]
    assert details[0] == f"pulling {IMAGE}:1", details
    assert any("Writing manifest" in d for d in details), details
    run = json.loads((state / "run.json").read_text())
    port = final.detail.split(":")[-1].split()[0]
    assert f"127.0.0.1:{port}:{port}" in run and "CUDA_VISIBLE_DEVICES=1" in run

    def container_of(beat: Heartbeat) -> str:
        return next((w.container for w in beat.workloads if w.name == "boxed"), "")

    await wait_for(lambda: beats.beats and container_of(beats.beats[-1]) == CONTAINER_ID)
    stop = await send(bus, prefix, operator, Stop(name="boxed"))
    assert (await results.final(stop.id)).status == "done"
    assert "node-agent-n1-boxed" in (state / "removed").read_text()


def podman_cannot_run(image_dir: Path) -> str:
    """Why the real podman cannot run the test image here ("" when it can); builds it."""
    if shutil.which("podman") is None:
        return "podman is not installed"
    if shutil.which("gcc") is None:
        return "gcc (to build the image's static server) is not installed"
    image_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(SUPPORT / "Containerfile", image_dir / "Containerfile")
    steps = [
        [
            "gcc",
            "-static",
            "-O2",
            "-o",
            str(image_dir / "tiny_server"),
            str(SUPPORT / "tiny_server.c"),
        ],
        ["podman", "build", "-q", "-t", TEST_IMAGE, str(image_dir)],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            return f"{' '.join(step[:2])} failed: {done.stderr.strip()[-300:]}"
    probe = subprocess.run(
        ["podman", "run", "--rm", "--pull", "never", "--network", "none", TEST_IMAGE,
         "/tiny_server", "--probe"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if probe.returncode != 0 or probe.stdout.strip() != "ok":
        return f"podman run fails here: {probe.stderr.strip()[-300:]}"
    return ""


@pytest.mark.slow
async def test_a_real_podman_container_starts_is_ready_and_stops(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """With the real podman and an image built here FROM scratch (one static server): the
    container workload goes ready, answers through its published port and stops."""
    reason = await asyncio.to_thread(podman_cannot_run, tmp_path / "image")
    if reason:
        print(f"SKIPPED (podman): {reason}")
        pytest.skip(reason)
    operator = signing.KeyPair.generate()
    results = await Results().start(bus, prefix)
    await agent(fleet, operator, workload_images=[TEST_IMAGE], workload_image_pull="never")
    deploy = Deploy(name="real", engine="process", image=TEST_IMAGE, ready_timeout=60.0, env={})
    command = await send(bus, prefix, operator, deploy)
    final = await results.final(command.id, timeout=90)
    assert final.status == "done", final.detail
    port = final.detail.split(":")[-1].split()[0]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/health") as response:
            assert response.status == 200
    started = time.monotonic()
    stop = await send(bus, prefix, operator, Stop(name="real"))
    assert (await results.final(stop.id, timeout=60)).status == "done"
    assert time.monotonic() - started < 60
    gone = await asyncio.create_subprocess_exec(
        "podman", "container", "exists", "node-agent-n1-real"
    )  # fmt: skip
    assert await gone.wait() == 1

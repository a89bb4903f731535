"""On-demand servers: a real agent whose gateway, asked for a model its model directory
holds, starts the llama.cpp stand-in for it on the GPU with the most free memory and
answers the request; what is not on disk, or beyond the per-GPU bound, is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from actors.node.agent import NodeAgent
from actors.node.gateway.access import Refusal
from actors.node.gateway.autostart import Autostart, workload_name
from schemas.events import Workload, WorkloadState
from schemas.workloads import Deploy
from tests.support.fleet import Fleet, node_events, wait_for
from tests.support.workloads import killing_leftovers, standin_script


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    with killing_leftovers():
        yield


async def agent(fleet: Fleet, tmp_path: Path, **settings: Any) -> tuple[NodeAgent, str]:
    """An agent with gateway_autostart over ``tmp_path/models``; its gateway's URL."""
    standin = standin_script(tmp_path / "bin")
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").write_bytes(b"GGUF")
    (tmp_path / "secret.gguf").write_bytes(b"GGUF")
    values: dict[str, Any] = dict(
        workload_binaries=[f"llamacpp={standin}"],
        gateway="on",
        gateway_autostart=True,
        model_dir=str(models),
        gateway_autostart_timeout=30.0,
    )
    started = await fleet.start_agent(fleet.config(**(values | settings)))
    assert started.supervisor is not None and await started.supervisor.wait_ready(10)
    port_file = Path(started.config.state_dir) / "gateway.port"
    await wait_for(port_file.exists)
    return started, f"http://127.0.0.1:{int(port_file.read_text())}"


async def ask(url: str, model: str) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=40)) as session,
        session.post(url + "/v1/chat/completions", json=body) as response,
    ):
        return response.status, await response.json()


async def test_a_model_on_disk_is_started_and_answered(fleet: Fleet, tmp_path: Path) -> None:
    """The first request for ``tiny.gguf`` starts a server for it and is answered 200;
    the server is the ``auto-tiny`` workload on a GPU of its own; the next reuses it."""
    started, url = await agent(fleet, tmp_path)
    status, body = await ask(url, "tiny.gguf")
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
    saved = (Path(started.config.state_dir) / "workloads.json").read_text()
    assert '"name":"auto-tiny"' in saved and '"share":false' in saved  # one a GPU: its own
    status, _ = await ask(url, "tiny")
    assert status == 200
    saved = (Path(started.config.state_dir) / "workloads.json").read_text()
    assert saved.count('"name":') == 1


async def test_what_is_not_in_the_model_directory_is_404(fleet: Fleet, tmp_path: Path) -> None:
    """A model not in model_dir, or a path out of it, starts nothing and is 404; under
    ``gateway = auto`` the gateway listens from the start to take such requests."""
    started, url = await agent(fleet, tmp_path, gateway="auto")
    for model in ("missing.gguf", "../secret.gguf", str(tmp_path / "secret.gguf"), ".hidden"):
        status, body = await ask(url, model)
        assert status == 404 and body["error"]["code"] == "model_not_found", model
    assert not (Path(started.config.state_dir) / "workloads.json").exists()


def test_gpu_with_most_free_memory_and_room(fleet: Fleet) -> None:
    """The server goes on the GPU with the most free memory among those running fewer
    than gateway_servers_per_gpu such servers and no operator's workload; with every GPU
    full, on the GPU of an idle ready server (switched out there); all busy: 503."""
    config = fleet.config(gateway_autostart=True, gateway_servers_per_gpu=1)
    autostart = Autostart(config, fleet.bus, node_events(config))
    free = {0: 10, 1: 70, 2: 40}

    def running(
        name: str, gpu: int, load: int = 1, state: WorkloadState = "ready"
    ) -> tuple[Workload, int]:
        workload = Workload(
            name=name, engine="llamacpp", state=state, since=time.time(), port=1, gpus=[gpu]
        )
        return workload, load

    assert autostart.gpu([], free) == 1
    assert autostart.gpu([running("auto-a", 1)], free) == 2
    assert autostart.gpu([running("auto-a", 1), running("chat", 2)], free) == 0
    full = [running("auto-a", 1), running("chat", 2), running("auto-b", 0)]
    with pytest.raises(Refusal, match="no GPU has room") as refused:
        autostart.gpu(full, free)
    assert refused.value.status == 503
    idle = [running("auto-a", 1, load=0), running("chat", 2, load=0), running("auto-b", 0, 0)]
    assert autostart.gpu(idle, free) == 1
    loading = [running("auto-a", 1, 0, "starting"), running("chat", 2), running("auto-b", 0)]
    with pytest.raises(Refusal):
        autostart.gpu(loading, free)


async def test_a_server_ordered_counts_on_its_gpu_before_it_shows(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Orders not yet in the workloads event count on their GPU: two GPUs and one server
    a GPU take two models, the third is 503 (nor is a coming server switched out); the
    same model asked for again while it comes up is not ordered twice."""
    config = fleet.config(gateway_autostart=True, gateway_servers_per_gpu=1)
    autostart = Autostart(config, fleet.bus, node_events(config))
    free = {0: 10, 1: 70}
    assert await autostart.start(tmp_path / "a.gguf", [], free) == "auto-a"
    assert await autostart.start(tmp_path / "a.gguf", [], free) == "auto-a"
    assert {name: order.gpu for name, order in autostart.ordered.items()} == {"auto-a": 1}
    assert await autostart.start(tmp_path / "b.gguf", [], free) == "auto-b"
    assert autostart.ordered["auto-b"].gpu == 0
    with pytest.raises(Refusal, match="no GPU has room") as refused:
        await autostart.start(tmp_path / "c.gguf", [], free)
    assert refused.value.status == 503 and "auto-c" not in autostart.ordered


def test_every_model_file_has_a_server_name_of_its_own(tmp_path: Path) -> None:
    """Files whose stems read alike (``a b`` and ``a-b``, ``x`` and ``x.gguf``, long names
    sharing their start) get distinct workload names, each a valid one."""
    names = ["a b.gguf", "a-b.gguf", "x", "x.gguf", "x.bin", "a.b.gguf", "é.gguf"]
    names += ["l" * 70 + ".gguf", "l" * 70 + "m.gguf"]
    made = [workload_name(tmp_path / name) for name in names]
    assert len(set(made)) == len(made), made
    assert made[1] == "auto-a-b" and made[3] == "auto-x"
    for name in made:  # decoding checks the name against the wire's pattern
        wire = msgspec.json.encode(Deploy(name=name, engine="llamacpp"))
        assert msgspec.json.decode(wire, type=Deploy).name == name


def test_a_model_is_passed_by_its_absolute_path(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a relative model_dir of ``.``, a file named ``-x.gguf`` is passed as an
    absolute path, never as something an engine would read as an option."""
    (tmp_path / "-x.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    config = fleet.config(gateway_autostart=True, model_dir=".")
    path = Autostart(config, fleet.bus, node_events(config)).model_file("-x")
    assert path == tmp_path.resolve() / "-x.gguf"


async def test_a_full_gpu_switches_its_idle_server(fleet: Fleet, tmp_path: Path) -> None:
    """With one GPU and one server a GPU, a request for a second model on disk switches
    the idle server out (stopped, its GPU given to the new one) and is answered."""
    started, url = await agent(fleet, tmp_path, fake_gpus=1)
    (tmp_path / "models" / "other.gguf").write_bytes(b"GGUF")
    assert (await ask(url, "tiny.gguf"))[0] == 200
    status, body = await ask(url, "other.gguf")
    assert status == 200, body
    saved = (Path(started.config.state_dir) / "workloads.json").read_text()
    assert '"name":"auto-other"' in saved and "auto-tiny" not in saved

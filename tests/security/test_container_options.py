"""Attacks on container workloads by an operator key: signed deploys whose image names or
arguments try podman's own options (``--privileged``, ``-v /:/host``, ``--network host``,
``--cap-add``, ``--device``, ...), registry tricks (``..``, uppercase, short digests,
a tag that is an option) and engine flags meant for podman. Each is refused with a
one-line reason in the command result, or, for a ``process`` deploy's own command,
reaches podman only after ``--`` and the image: the container's argv, never podman's
options (shown with the podman stand-in's recorded argv, and with the real podman's
``create`` and ``inspect`` where podman is installed)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.node.config import AgentConfig
from actors.node.workloads import container
from actors.node.workloads.launch import NotAllowed, command_line
from actors.runtime.bus import NatsBus
from schemas import signing
from schemas.workloads import Deploy
from tests.node.test_workload_container import IMAGE, agent
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, wait_for
from tests.support.workloads import fake_podman_script, killing_leftovers

PODMAN_OPTIONS: list[list[str]] = [
    ["--privileged"],
    ["-v", "/:/host"],
    ["--volume=/:/host"],
    ["--mount", "type=bind,src=/,dst=/host"],
    ["--network", "host"],
    ["--net=host"],
    ["--pid", "host"],
    ["--cap-add", "ALL"],
    ["--device", "/dev/mem"],
    ["--security-opt", "seccomp=unconfined"],
    ["--userns=host"],
]
"""Podman's options that would break the container's confinement, as a deploy's args."""
HOSTILE_ARGS = [arg for option in PODMAN_OPTIONS for arg in option]
BAD_IMAGES = [
    "--privileged",
    "-v",
    f"{IMAGE}:1 --privileged",
    f"{IMAGE}:--privileged",
    f"{IMAGE}:-v",
    "registry.example/../llama:1",
    "registry.example/llama/../llama:1",
    "Registry.example/LLAMA:1",
    f"{IMAGE}@sha256:00",
    f"{IMAGE}:",
    f"{IMAGE}:1\n",
]
"""Image names with options embedded, or outside the registry's reference grammar."""


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    with killing_leftovers():
        yield


def node(**settings: Any) -> AgentConfig:
    values: dict[str, Any] = {
        "node_id": "n1",
        "workload_engines": ["llamacpp", "process"],
        "workload_images": [IMAGE, "--privileged", "-v", "localhost"],
    }
    return AgentConfig(**(values | settings))


def hostile_deploys() -> list[tuple[Deploy, str]]:
    """Deploys that must be refused, each with what its reason says."""
    cases: list[tuple[Deploy, str]] = []
    for image in BAD_IMAGES:
        deploy = Deploy(name="boxed", engine="process", image=image, args=["/srv"])
        cases.append((deploy, "is not an image reference"))
    look_alike = Deploy(name="boxed", engine="process", image="localhost:5000/evil", args=["x"])
    cases.append((look_alike, "not in this node's workload_images"))
    for option in PODMAN_OPTIONS:
        flag = option[0].partition("=")[0]
        deploy = Deploy(name="boxed", engine="llamacpp", model="/m/x", image=IMAGE, args=option)
        cases.append((deploy, f"argument {flag} may not be given"))
    for model in ("--privileged", "--trust-remote-code", "-v"):
        deploy = Deploy(name="boxed", engine="llamacpp", model=model, image=IMAGE + ":1")
        cases.append((deploy, "starts with '-'"))
    return cases


def test_podman_options_in_images_args_or_models_are_refused() -> None:
    """Every hostile image name, engine argument and model is refused, saying why in one
    line, even where the node's allow-list holds a name that looks like an option."""
    for deploy, says in hostile_deploys():
        with pytest.raises(NotAllowed, match=says) as refused:
            command_line(node(), deploy, 9000)
        assert "\n" not in str(refused.value), deploy


def test_a_command_after_the_image_is_the_containers_own() -> None:
    """A ``process`` deploy's args made of podman's options come after ``--`` and the
    image, verbatim; podman's options before them are the node's alone, the same as for a
    harmless command."""
    config = node()
    cid = Path("/nonexistent/boxed.cid")
    deploy = Deploy(name="boxed", engine="process", image=IMAGE + ":1", args=HOSTILE_ARGS)
    inner = command_line(config, deploy, 9000)
    argv = container.run_argv(config, deploy, 9000, inner, cid, {}, cdi=False)
    end = argv.index("--")
    assert argv[end + 1 :] == [IMAGE + ":1", *HOSTILE_ARGS]
    harmless = Deploy(name="boxed", engine="process", image=IMAGE + ":1", args=["/srv"])
    plain = container.run_argv(config, harmless, 9000, ["/srv"], cid, {}, cdi=False)
    assert argv[:end] == plain[: plain.index("--")]


async def test_signed_hostile_deploys_are_rejected_with_the_reason(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Through FLEET_CMD, an operator's signed deploys with hostile images, podman options
    as engine args, or option-like models are each rejected with a one-line reason, and
    podman never runs; a process deploy made of podman's options runs them only as the
    container's own command (the stand-in's recorded argv)."""
    operator = signing.KeyPair.generate()
    results = await Results().start(bus, prefix)
    state = tmp_path / "podman-state"
    podman = fake_podman_script(tmp_path / "bin", state)
    images = [IMAGE, "--privileged", "-v", "localhost"]
    await agent(fleet, operator, workload_podman=str(podman), workload_images=images)
    for deploy, says in hostile_deploys():
        command = await send(bus, prefix, operator, deploy)
        final = await results.final(command.id)
        assert final.status == "rejected" and says in final.detail, (deploy, final.detail)
        assert "\n" not in final.detail and "Traceback" not in final.detail
    assert not (state / "run.json").exists()
    deploy = Deploy(
        name="boxed", engine="process", image=IMAGE + ":1", args=HOSTILE_ARGS, ready_timeout=5
    )
    await send(bus, prefix, operator, deploy)
    await wait_for(lambda: (state / "run.json").exists())
    argv = json.loads((state / "run.json").read_text())
    assert argv[argv.index("--") + 1 :] == [IMAGE + ":1", *HOSTILE_ARGS]


def empty_image(directory: Path) -> str:
    """An empty image imported into the real podman ("" when podman cannot); its name."""
    directory.mkdir(parents=True, exist_ok=True)
    archive = directory / "empty.tar"
    with tarfile.open(archive, "w"):
        pass
    name = f"localhost/node-agent-test-empty-{uuid.uuid4().hex[:8]}:1"
    try:
        done = subprocess.run(
            ["podman", "import", "-q", str(archive), name],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError:
        return ""
    return name if done.returncode == 0 else ""


@pytest.fixture
def podman_image(tmp_path: Path) -> Iterator[str]:
    """An empty image in the real podman, removed afterwards; skips where podman cannot
    import one (not installed, or no storage)."""
    name = empty_image(tmp_path / "image")
    if not name:
        print("SKIPPED (podman): podman cannot import an image here")
        pytest.skip("podman cannot import an image here")
    yield name
    subprocess.run(["podman", "rmi", "-f", name], capture_output=True, timeout=60, check=False)


async def test_real_podman_takes_the_command_as_the_containers_own(
    tmp_path: Path, podman_image: str
) -> None:
    """The real podman, given the node's ``podman run`` argv (as ``create``: nothing runs)
    for a process deploy made of podman's options, creates a container that is not
    privileged, mounts nothing, keeps its own network, PID and user namespaces, adds no
    capability or device, drops all capabilities, and has those options as its command."""
    node_id = f"sec-{uuid.uuid4().hex[:8]}"
    config = node(node_id=node_id, workload_images=[podman_image])
    deploy = Deploy(name="boxed", engine="process", image=podman_image, args=HOSTILE_ARGS)
    inner = command_line(config, deploy, 9000)
    argv = container.run_argv(config, deploy, 9000, inner, tmp_path / "c.cid", {}, cdi=False)
    assert argv[1] == "run"
    name = container.container_name(config, deploy)

    def create_and_inspect() -> dict[str, object]:
        try:
            created = subprocess.run(
                [argv[0], "create", *argv[2:]],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert created.returncode == 0, created.stderr
            shown = subprocess.run(
                ["podman", "inspect", name], capture_output=True, text=True, timeout=60, check=False
            )
            assert shown.returncode == 0, shown.stderr
            inspected: dict[str, object] = json.loads(shown.stdout)[0]
            return inspected
        finally:
            subprocess.run(
                ["podman", "rm", "-f", name], capture_output=True, timeout=60, check=False
            )

    inspected = await asyncio.to_thread(create_and_inspect)
    config_part = inspected["Config"]
    host = inspected["HostConfig"]
    assert isinstance(config_part, dict) and isinstance(host, dict)
    assert config_part["Cmd"] == HOSTILE_ARGS
    assert host["Privileged"] is False
    assert not host.get("Binds") and not inspected.get("Mounts")
    assert host["NetworkMode"] not in ("host", "none") and host["PidMode"] != "host"
    assert host.get("UsernsMode", "") in ("", "private")
    assert not host.get("CapAdd") and not host.get("Devices")
    assert host.get("CapDrop"), host.get("CapDrop")
    assert "no-new-privileges" in json.dumps(host.get("SecurityOpt"))
    assert host["PortBindings"] == {"9000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "9000"}]}

"""Attacks on ``gateway_autostart`` from a plain aiohttp client on the node: model names
that climb out of ``model_dir`` (``..``, absolute paths, URL-encoded or NUL-laden names,
very long ones, symlinks in the directory pointing out of it, a symlinked directory) start
nothing and are refused with a clear status; requests for many models at once start no
more servers than ``gateway_servers_per_gpu`` on each GPU."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.node.workloads import processes
from actors.node.workloads.store import WorkloadStore
from tests.node.test_gateway_autostart import agent, ask
from tests.support.fleet import Fleet
from tests.support.workloads import killing_leftovers

ESCAPES = (
    "../../etc/passwd",
    "/etc/passwd",
    "..",
    "../secret.gguf",
    "../models/tiny.gguf",
    "..%2f..%2fetc%2fpasswd",
    "%2e%2e%2fsecret.gguf",
    "..\\..\\etc\\passwd",
    ".hidden",
    "passwd",  # a symlink in model_dir to /etc/passwd
    "etc",  # a symlink in model_dir to /etc
    "up.gguf",  # a relative symlink to ../secret.gguf
    "up",
    "x" * 300,  # longer than a file name may be
)
"""Names that reach, or try to reach, a file outside the model directory: each is 404."""
MALFORMED = ("a\x00b", "tiny.gguf\x00", "tiny\n", "tiny\x1b[2J", "x" * 5000)
"""Names no model has (a NUL or another control character, more than 1024 characters):
each is 400 before anything looks for a file."""


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    with killing_leftovers():
        yield


def hostile_links(models: Path, outside: Path) -> None:
    """Symlinks in ``models`` that point out of it, and a hidden model."""
    (models / "passwd").symlink_to("/etc/passwd")
    (models / "etc").symlink_to("/etc")
    (models / "up.gguf").symlink_to(Path("..") / outside.name)
    (models / ".hidden").write_bytes(b"GGUF")


def saved_workloads(state_dir: str) -> list[str]:
    """Names of the workloads the agent keeps (none when it never started one)."""
    return [entry.deploy.name for entry in WorkloadStore(Path(state_dir)).load()]


async def test_names_out_of_the_model_directory_start_nothing(fleet: Fleet, tmp_path: Path) -> None:
    """Traversal, absolute, URL-encoded, hidden and overlong names and symlinks pointing out
    of model_dir are 404 ``model_not_found``; NUL, control characters and names over 1024
    characters are 400 ``invalid_model``: no workload, no process started, no 500."""
    children = set(processes._children)
    started, url = await agent(fleet, tmp_path)
    hostile_links(tmp_path / "models", tmp_path / "secret.gguf")
    for model in ESCAPES:
        status, body = await ask(url, model)
        assert (status, body["error"]["code"]) == (404, "model_not_found"), (model, body)
    for model in MALFORMED:
        status, body = await ask(url, model)
        assert (status, body["error"]["code"]) == (400, "invalid_model"), (model, body)
        assert "printable" in body["error"]["message"]
    assert saved_workloads(started.config.state_dir) == []
    assert set(processes._children) == children


async def test_a_symlinked_model_directory_serves_only_its_own_files(
    fleet: Fleet, tmp_path: Path
) -> None:
    """With model_dir a symlink to the real directory, its files are served by their path
    in the real directory, and a symlink in it pointing out of it is still refused."""
    real = tmp_path / "store"
    real.mkdir()
    (real / "tiny.gguf").write_bytes(b"GGUF")
    (real / "out.gguf").symlink_to(tmp_path / "secret.gguf")
    linked = tmp_path / "linked"
    linked.symlink_to(real)
    started, url = await agent(fleet, tmp_path, model_dir=str(linked))
    status, body = await ask(url, "out.gguf")
    assert (status, body["error"]["code"]) == (404, "model_not_found"), body
    assert saved_workloads(started.config.state_dir) == []
    status, body = await ask(url, "tiny")
    assert status == 200, body
    assert body["model"] == str(real.resolve() / "tiny.gguf")
    assert saved_workloads(started.config.state_dir) == ["auto-tiny"]


async def test_many_models_at_once_start_at_most_the_bound_a_gpu(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Eight models asked for at once on one GPU with two servers a GPU: two start and are
    answered, six are 503 ``no_capacity`` (a server ordered counts on its GPU before it
    shows); the node runs two servers and two processes."""
    children = set(processes._children)
    started, url = await agent(fleet, tmp_path, fake_gpus=1, gateway_servers_per_gpu=2)
    models = [f"m{i}" for i in range(8)]
    for model in models:
        (tmp_path / "models" / f"{model}.gguf").write_bytes(b"GGUF")
    answers = await asyncio.gather(*(ask(url, model) for model in models))
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200] * 2 + [503] * 6, answers
    refused = [body for status, body in answers if status == 503]
    assert all(body["error"]["code"] == "no_capacity" for body in refused), refused
    assert len(saved_workloads(started.config.state_dir)) == 2
    assert len(set(processes._children) - children) == 2

"""The gateway reachable from outside the node: TLS on a configured address, API keys
stored as hashes and rotated without a restart, client certificates, a rate limit per key,
and the endpoint URL advertised in the heartbeat; the default stays loopback, no auth."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import msgspec
import pytest
from aiohttp import web

from actors.cli import node_agent
from actors.node.gateway.access import ApiKeys, key_line, new_key
from actors.node.gateway.actor import GatewayActor
from actors.runtime.config import ConfigError
from tests.node.test_gateway import (
    MODEL,
    FakeLlama,
    chat,
    is_openai_error,
    publish_workloads,
    workload,
)
from tests.support.fleet import Fleet, node_events, wait_for, wait_record
from tests.support.pki import Pki

HOST = "127.0.0.2"
"""A loopback address other than the default: the gateway listens where it is told."""


class RecordingLlama(FakeLlama):
    """The fake engine, remembering the Authorization header each request brought."""

    def __init__(self, model: str = MODEL) -> None:
        super().__init__(model)
        self.authorizations: list[str | None] = []

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.append(request.headers.get("Authorization"))
        self.release.set()
        return await super().complete(request)


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as exits:
        yield exits


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    authority = Pki(tmp_path / "pki")
    authority.issue("gateway", HOST, "127.0.0.1")
    return authority


def tls_settings(pki: Pki, **settings: Any) -> dict[str, Any]:
    return {
        "gateway_host": HOST,
        "gateway_tls_cert": str(pki.dir / "gateway.pem"),
        "gateway_tls_key": str(pki.dir / "gateway-key.pem"),
        **settings,
    }


async def start(fleet: Fleet, stack: AsyncExitStack, **settings: Any) -> tuple[RecordingLlama, str]:
    """A listening gateway with one ready workload behind it: the engine, the base URL."""
    values: dict[str, Any] = {"gateway": "on", "gateway_port": 0}
    config = fleet.config(**(values | settings))
    gateway = GatewayActor(config, fleet.bus, node_events(config))
    await fleet.start_supervisor(gateway)
    port = await wait_for(lambda: gateway.port)
    engine = await RecordingLlama.started(stack)
    assert isinstance(engine, RecordingLlama)
    engine.release.set()
    await publish_workloads(fleet, gateway, workload("a", engine.port))
    return engine, f"https://{HOST}:{port}"


async def ask(
    url: str, context: ssl.SSLContext, key: str = "", path: str = "/v1/chat/completions"
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One request with a plain aiohttp client, with ``key`` as a bearer token if given."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        if path == "/v1/models":
            request = client.get(url + path, headers=headers, ssl=context)
        else:
            request = client.post(url + path, json=chat(), headers=headers, ssl=context)
        async with request as response:
            return response.status, await response.json(), dict(response.headers)


async def test_key_required_over_tls_on_a_configured_address(
    fleet: Fleet, stack: AsyncExitStack, pki: Pki, tmp_path: Path
) -> None:
    """On 127.0.0.2 with TLS and a keys file: no key or a wrong key is 401 in OpenAI's
    format, the right key 200; the engine never sees the client's key."""
    key = new_key()
    keys = tmp_path / "keys"
    keys.write_text(f"# gateway keys\n{key_line('alice', key)}\n")
    engine, url = await start(fleet, stack, **tls_settings(pki, gateway_keys_file=str(keys)))
    context = pki.client()
    status, body, headers = await ask(url, context)
    assert status == 401 and is_openai_error(body, "invalid_api_key")
    assert headers["WWW-Authenticate"].startswith("Bearer")
    status, body, _ = await ask(url, context, "nak_wrong")
    assert status == 401 and is_openai_error(body, "invalid_api_key")
    status, _, _ = await ask(url, context, key, "/v1/models")
    assert status == 200
    status, body, _ = await ask(url, context, key)
    assert status == 200 and body["choices"][0]["message"]["content"] == "hi"
    assert engine.authorizations == [None]
    assert key not in keys.read_text()
    with pytest.raises(aiohttp.ClientError):  # TLS only: plain HTTP is not answered
        async with (
            aiohttp.ClientSession() as client,
            client.get(url.replace("https", "http") + "/v1/models") as response,
        ):
            await response.read()


async def test_keys_rotate_without_restart(
    fleet: Fleet, stack: AsyncExitStack, pki: Pki, tmp_path: Path
) -> None:
    """A key added to the file works at once; a key removed is refused at once."""
    old, new = new_key(), new_key()
    keys = tmp_path / "keys"
    keys.write_text(key_line("old", old) + "\n")
    _, url = await start(fleet, stack, **tls_settings(pki, gateway_keys_file=str(keys)))
    context = pki.client()
    assert (await ask(url, context, new))[0] == 401
    keys.write_text(key_line("old", old) + "\n" + key_line("new", new) + "\n")
    assert (await ask(url, context, new))[0] == 200
    replacement = tmp_path / "keys.new"
    replacement.write_text(key_line("new", new) + "\n")
    replacement.replace(keys)  # as an editor or config manager replaces a file
    assert (await ask(url, context, old))[0] == 401
    assert (await ask(url, context, new))[0] == 200


async def test_a_key_replaced_within_one_timestamp_tick_is_refused(
    fleet: Fleet, stack: AsyncExitStack, pki: Pki, tmp_path: Path
) -> None:
    """A key rewritten in place by another of the same length with the same modification
    time (a rewrite within one timestamp tick; set in the future here so it stays within
    the tick however slow the run) is refused at once, the new one accepted."""
    old, new = new_key(), new_key()
    keys = tmp_path / "keys"
    keys.write_text(key_line("ops", old) + "\n")
    tick = time.time_ns() + 3600 * 10**9
    os.utime(keys, ns=(tick, tick))
    _, url = await start(fleet, stack, **tls_settings(pki, gateway_keys_file=str(keys)))
    context = pki.client()
    assert (await ask(url, context, old))[0] == 200
    inode = keys.stat().st_ino
    with keys.open("r+") as rewrite:  # in place: same inode, same size
        rewrite.write(key_line("ops", new) + "\n")
    os.utime(keys, ns=(tick, tick))
    assert (keys.stat().st_ino, keys.stat().st_mtime_ns) == (inode, tick)
    assert (await ask(url, context, old))[0] == 401
    assert (await ask(url, context, new))[0] == 200


def test_keys_are_looked_up_by_their_digest_only(tmp_path: Path) -> None:
    """The constant-time mechanism: the only lookup is of the SHA-256 digest of what the
    client sent in a table of 32-byte digests, so no comparison runs over a key (or stops
    early on a prefix it shares); an unknown key and one differing in its last character
    look up unrelated digests."""
    key = new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text(key_line("ops", key) + "\n")
    os.utime(keys_file, (time.time() - 3600, time.time() - 3600))  # settled: not read again
    keys = ApiKeys(str(keys_file))
    assert all(isinstance(d, bytes) and len(d) == 32 for d in keys._names)

    class Recording(dict[bytes, str]):
        looked_up: ClassVar[list[bytes]] = []

        def get(self, digest: bytes, default: Any = None) -> Any:
            self.looked_up.append(digest)
            return super().get(digest, default)

    keys._names = Recording(keys._names)
    near = key[:-1] + ("A" if key[-1] != "A" else "B")
    sent = [key, near, new_key(), "", "\udcff"]
    assert [keys.name_of(k) for k in sent] == ["ops", None, None, None, None]
    assert Recording.looked_up == [
        hashlib.sha256(k.encode("utf-8", "surrogateescape")).digest() for k in sent
    ]
    assert Recording.looked_up[0][:4] != Recording.looked_up[1][:4]


async def test_unknown_and_near_miss_keys_are_answered_alike(
    fleet: Fleet, stack: AsyncExitStack, pki: Pki, tmp_path: Path
) -> None:
    """A random key, the key with its last character changed, the stored digest, a raw key
    pasted into the file in place of its hash, and bytes that are not UTF-8 each get the
    same 401 (status, body, headers but Date), never a 500."""
    key, pasted = new_key(), new_key()
    keys = tmp_path / "keys"
    stored = key_line("ops", key)
    keys.write_text(f"{stored}\nraw:{pasted}\n")
    _, url = await start(fleet, stack, **tls_settings(pki, gateway_keys_file=str(keys)))
    context = pki.client()
    near = key[:-1] + ("A" if key[-1] != "A" else "B")
    answers = []
    for sent in (new_key(), near, stored.partition("$")[2], pasted):
        status, body, headers = await ask(url, context, sent)
        answers.append((status, body, headers.get("WWW-Authenticate")))
    assert answers == [answers[0]] * 4 and answers[0][0] == 401, answers
    raw = await raw_request(url, context, b"Authorization: Bearer nak_\xff\xfe\xc3(")
    assert raw.startswith(b"HTTP/1.1 401 "), raw
    assert (await ask(url, context, key))[0] == 200


async def raw_request(url: str, context: ssl.SSLContext, header: bytes) -> bytes:
    """The status line answering a chat request sent over TLS with ``header`` as raw bytes
    (a client aiohttp's own would not send)."""
    host, _, port = url.removeprefix("https://").rpartition(":")
    body = msgspec.json.encode(chat())
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n" + header
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip
    reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
    try:
        writer.write(request)
        async with asyncio.timeout(10):
            return await reader.readline()
    finally:
        writer.close()


async def test_rate_limited_per_key(
    fleet: Fleet, stack: AsyncExitStack, pki: Pki, tmp_path: Path
) -> None:
    """A key past its burst gets 429 with Retry-After; another key is not held back."""
    busy, quiet = new_key(), new_key()
    keys = tmp_path / "keys"
    keys.write_text(f"{key_line('busy', busy)}\n{key_line('quiet', quiet)}\n")
    settings = tls_settings(
        pki, gateway_keys_file=str(keys), gateway_rate_limit=0.01, gateway_rate_burst=2
    )
    _, url = await start(fleet, stack, **settings)
    context = pki.client()
    # Refused keys take nothing from a bucket: a flood of wrong keys leaves busy's burst.
    assert {(await ask(url, context, busy[:-1] + "!"))[0] for _ in range(5)} == {401}
    assert [(await ask(url, context, busy))[0] for _ in range(2)] == [200, 200]
    status, body, headers = await ask(url, context, busy)
    assert status == 429 and is_openai_error(body, "rate_limit_exceeded")
    assert int(headers["Retry-After"]) >= 1
    assert (await ask(url, context, quiet))[0] == 200


async def test_mutual_tls_requires_a_client_certificate(
    fleet: Fleet, stack: AsyncExitStack, pki: Pki
) -> None:
    """With gateway_tls_client_ca a client without a certificate of that CA is refused in
    the handshake; one with a certificate is served."""
    settings = tls_settings(pki, gateway_tls_client_ca=str(pki.ca_file))
    _, url = await start(fleet, stack, **settings)
    with pytest.raises(aiohttp.ClientError):
        await ask(url, pki.client())
    status, _, _ = await ask(url, pki.client("dispatcher"))
    assert status == 200


async def test_endpoint_advertised_in_the_heartbeat(fleet: Fleet, pki: Pki, tmp_path: Path) -> None:
    """A node whose gateway listens on 127.0.0.2 with TLS advertises
    https://127.0.0.2:<port> in its heartbeat; the default gateway advertises nothing."""
    keys = tmp_path / "keys"
    keys.write_text(key_line("a", new_key()) + "\n")
    # A record that only beats is written every checkpoint_interval: one second here.
    await fleet.start_aggregator(checkpoint_interval=1.0)
    config = fleet.config(
        gateway="on", **tls_settings(pki, gateway_keys_file=str(keys))
    )  # fmt: skip
    await fleet.start_agent(config)
    record = await wait_record(
        fleet.bus,
        fleet.prefix,
        "n1",
        lambda r: r.heartbeat is not None and bool(r.heartbeat.endpoint),
    )
    port = int((Path(config.state_dir) / "gateway.port").read_text())
    assert record.heartbeat is not None
    assert record.heartbeat.endpoint == f"https://{HOST}:{port}"
    await fleet.start_agent(fleet.config("n2", gateway="on"))
    plain = await wait_record(
        fleet.bus, fleet.prefix, "n2", lambda r: r.heartbeat is not None and r.heartbeat.seq > 2
    )
    assert plain.heartbeat is not None and plain.heartbeat.endpoint == ""


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"gateway_host": "0.0.0.0"}, "gateway_tls_cert"),
        (
            {"gateway_host": "0.0.0.0", "gateway_tls_cert": "c", "gateway_tls_key": "k"},
            "gateway_keys_file or gateway_tls_client_ca",
        ),
        ({"gateway_tls_cert": "c"}, "go together"),
    ],
)
def test_beyond_loopback_needs_tls_and_a_client_check(
    fleet: Fleet, settings: dict[str, Any], says: str
) -> None:
    """A gateway on 0.0.0.0 without TLS, or without keys or client CA, is a config error."""
    with pytest.raises((ValueError, msgspec.ValidationError), match=says):
        fleet.config(**settings)


def test_gateway_key_command_stores_only_the_hash(tmp_path: Path) -> None:
    """``node-agent gateway-key`` prints a new key and appends only its hash to the file,
    which the gateway then accepts the key by."""
    keys = tmp_path / "keys"
    out = StringIO()
    with redirect_stdout(out):
        assert node_agent.main(["gateway-key", "ops", "--keys-file", str(keys)]) == 0
    key = out.getvalue().strip()
    assert key.startswith("nak_") and key not in keys.read_text()
    assert keys.stat().st_mode & 0o777 == 0o600
    assert ApiKeys(str(keys)).name_of(key) == "ops"
    assert ApiKeys(str(keys)).name_of(key + "x") is None


def test_unreadable_tls_or_keys_file_is_a_one_line_config_error(
    fleet: Fleet, pki: Pki, tmp_path: Path
) -> None:
    """A keys file, certificate or client CA that cannot be read stops the start with a
    ConfigError naming the setting and the file, not a traceback from ssl."""
    keys = tmp_path / "keys"
    keys.write_text(key_line("a", new_key()) + "\n")
    cases = [
        (tls_settings(pki, gateway_keys_file=str(tmp_path / "none")), "gateway_keys_file"),
        (
            tls_settings(
                pki, gateway_tls_cert=str(tmp_path / "none.pem"), gateway_keys_file=str(keys)
            ),
            "gateway_tls_cert: file .*none.pem not found",
        ),
        (
            tls_settings(pki, gateway_tls_client_ca=str(pki.dir / "gateway-key.pem")),
            "gateway_tls_client_ca: .*no PEM certificate",
        ),
    ]
    for settings, says in cases:
        config = fleet.config(**settings)
        with pytest.raises(ConfigError, match=says):
            GatewayActor(config, fleet.bus, node_events(config))

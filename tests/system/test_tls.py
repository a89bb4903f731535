"""TLS and mutual TLS from the client side: a real nats-server whose ``tls`` block requires
a client certificate (``verify: true``), certificates made per run by trustme. An agent
and an aggregator work through it, ``fleetctl drain --wait`` too; every refusal is one
line naming its cause, and the systemd units hand the files over as credentials."""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from actors.cli import node_agent
from actors.cli.common import settings_from
from actors.cli.fleetctl import main as fleetctl
from actors.fleet.config import ENV_PREFIX as AGGREGATOR_ENV_PREFIX
from actors.fleet.config import AggregatorConfig
from actors.fleet.storage.streams import provision
from actors.node.config import ENV_PREFIX, AgentConfig
from actors.runtime.bus import NatsBus
from actors.runtime.config import ConfigError
from actors.runtime.connect_failures import BusError
from actors.runtime.embedded import NatsServer
from actors.runtime.tls import client_context
from schemas import signing
from schemas.subjects import Subjects
from tests.support.fleet import TEST_LIMITS, Fleet, wait_record

BIN = Path(sys.executable).parent
DEPLOY = Path(__file__).parent.parent.parent / "deploy" / "nats"


@dataclass(frozen=True)
class Pki:
    """PEM files of one test run: the fleet's CA, a server certificate for 127.0.0.1 only,
    a client certificate it signed, and a second CA with a client certificate of its own."""

    ca: str
    server_cert: str
    server_key: str
    cert: str
    key: str
    other_ca: str
    other_cert: str
    other_key: str

    def flags(self) -> list[str]:
        return ["--tls-ca", self.ca, "--tls-cert", self.cert, "--tls-key", self.key]


def _issue(ca: trustme.CA, name: str, directory: Path, stem: str) -> tuple[str, str]:
    issued = ca.issue_cert(name)
    cert, key = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return str(cert), str(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    other.cert_pem.write_to_path(str(directory / "other-ca.pem"))
    server_cert, server_key = _issue(ca, "127.0.0.1", directory, "server")
    cert, key = _issue(ca, "n1", directory, "client")
    other_cert, other_key = _issue(other, "n1", directory, "other-client")
    return Pki(
        str(directory / "ca.pem"),
        server_cert,
        server_key,
        cert,
        key,
        str(directory / "other-ca.pem"),
        other_cert,
        other_key,
    )


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[NatsServer]:
    """Overrides conftest's: JetStream behind mutual TLS on a nats:// port (tls_required)."""
    directory = tmp_path_factory.mktemp("nats-tls")
    conf = directory / "nats.conf"
    conf.write_text(
        "listen: 127.0.0.1:-1\n"
        f'jetstream {{ store_dir: "{directory / "js"}" }}\n'
        "tls {\n"
        f'  cert_file: "{pki.server_cert}"\n'
        f'  key_file: "{pki.server_key}"\n'
        f'  ca_file: "{pki.ca}"\n'
        "  verify: true\n"
        "}\n"
    )
    server = NatsServer(directory, config_file=conf)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server: NatsServer, pki: Pki, prefix: str) -> AsyncIterator[NatsBus]:
    """Overrides conftest's: the test's bus over mutual TLS, this test's streams provisioned."""
    tls = client_context(pki.ca, pki.cert, pki.key)
    connected = await NatsBus.connect(nats_server.url, "test", tls=tls)
    await provision(connected.js, Subjects(prefix), limits=TEST_LIMITS)
    yield connected
    await connected.close()


def tls_settings(pki: Pki) -> dict[str, str]:
    return {"tls_ca": pki.ca, "tls_cert": pki.cert, "tls_key": pki.key}


async def test_agent_beats_through_mutual_tls(fleet: Fleet, pki: Pki) -> None:
    """An agent with a client certificate, on a nats:// URL the server upgrades, and an
    aggregator on a tls:// connection: the node is recorded active."""
    port = fleet.url.rsplit(":", 1)[1]
    tls = client_context(pki.ca, pki.cert, pki.key)
    aggregator_bus = await NatsBus.connect(f"tls://127.0.0.1:{port}", "aggregator", tls=tls)
    fleet.stack.push_async_callback(aggregator_bus.close)
    await fleet.start_aggregator(aggregator_bus)
    await fleet.start_agent(fleet.config(**tls_settings(pki)))
    record = await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
    assert record.heartbeat is not None


def refusal_cases(pki: Pki, url: str) -> dict[str, tuple[str, str, str, str]]:
    """Each case's URL, tls_ca, client certificate (none, ours, another CA's) and what its
    reason says. A refused client certificate reads two ways: under TLS 1.3 the server's
    alert can arrive after the client has written and found the socket closed."""
    port = url.rsplit(":", 1)[1]
    return {
        "no client certificate": (
            url,
            pki.ca,
            "",
            "set tls_cert and tls_key",
        ),
        "wrong CA": (
            url,
            pki.other_ca,
            "own",
            "TLS: certificate verify failed: unable to get local issuer certificate "
            "(is tls_ca the CA that signed the server's certificate?)",
        ),
        "client certificate of another CA": (
            url,
            pki.ca,
            "other",
            "client certificate",
        ),
        "hostname mismatch": (
            f"tls://localhost:{port}",
            pki.ca,
            "own",
            "TLS: certificate verify failed: Hostname mismatch, certificate is not valid "
            "for 'localhost'",
        ),
        "TLS required, none configured": (
            url,
            "",
            "",
            "TLS: certificate verify failed: unable to get local issuer certificate "
            "(the server requires TLS: set tls_ca to the CA that signed its certificate)",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "no client certificate",
        "wrong CA",
        "client certificate of another CA",
        "hostname mismatch",
        "TLS required, none configured",
    ],
)
async def test_refusal_names_its_cause(nats_server: NatsServer, pki: Pki, case: str) -> None:
    url, ca, client, expected = refusal_cases(pki, nats_server.url)[case]
    cert, key = {
        "": ("", ""),
        "own": (pki.cert, pki.key),
        "other": (pki.other_cert, pki.other_key),
    }[client]
    with pytest.raises(BusError) as refused:
        await NatsBus.connect(url, "test", tls=client_context(ca, cert, key), connect_timeout=2)
    assert refused.value.reason.startswith("TLS: "), refused.value.reason
    assert expected in refused.value.reason
    assert "no server answered" not in str(refused.value)


async def test_tls_url_to_a_plaintext_server_is_refused(tmp_path: Path, pki: Pki) -> None:
    """nats-py would stay plaintext on a tls:// URL when the server offers no TLS."""
    with NatsServer(tmp_path) as plain:
        port = plain.url.rsplit(":", 1)[1]
        for url, tls in [(f"tls://127.0.0.1:{port}", None), (plain.url, client_context(pki.ca))]:
            with pytest.raises(BusError, match="the server does not offer TLS"):
                await NatsBus.connect(url, "test", tls=tls, connect_timeout=2)


async def run(program: str, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(BIN / program),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_register_without_client_certificate_is_one_line(
    nats_server: NatsServer, pki: Pki, tmp_path: Path
) -> None:
    """node-agent register (which, unlike start, does not retry) says why it was refused."""
    signing.create_key_file(tmp_path / "node.nk")
    code, _, err = await run(
        "node-agent",
        "register",
        "--server",
        nats_server.url,
        "--state-dir",
        str(tmp_path),
        "--tls-ca",
        pki.ca,
    )
    assert code == 1
    assert err.startswith(f"error: cannot reach NATS at {nats_server.url}: TLS: ")
    assert err.endswith("(set tls_cert and tls_key)\n") and err.count("\n") == 1


async def test_drain_wait_over_tls(fleet: Fleet, pki: Pki, tmp_path: Path) -> None:
    """fleetctl drain --wait, a real process with the TLS flags, follows the node to drained."""
    operator = signing.create_key_file(tmp_path / "operator.nk")
    await fleet.start_aggregator()
    await fleet.start_agent(
        fleet.config(trust_operators=[operator.public_key], **tls_settings(pki))
    )
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
    code, out, err = await run(
        "fleetctl",
        "drain",
        "n1",
        "--deadline",
        "30",
        "--wait",
        "--server",
        fleet.url,
        "--prefix",
        fleet.prefix,
        "--key-file",
        str(tmp_path / "operator.nk"),
        *pki.flags(),
    )
    assert code == 0, err
    assert out.splitlines()[-1].startswith("done: drained")
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "drained")


async def test_bad_tls_key_path_is_one_config_line(pki: Pki) -> None:
    code, _, err = await run(
        "fleetctl", "nodes", "--tls-ca", pki.ca, "--tls-cert", pki.cert, "--tls-key", "/nope.pem"
    )
    assert (code, err) == (1, "error: config: tls_key: file /nope.pem not found\n")


def test_client_context_refuses_bad_files(pki: Pki) -> None:
    assert client_context() is None
    cases = {
        "tls_cert and tls_key go together": ("", pki.cert, ""),
        f"tls_ca: {pki.key} holds no PEM certificate": (pki.key, "", ""),
        "are not a PEM certificate and its private key": ("", pki.cert, pki.other_key),
        "tls_cert: file /nope.pem not found": ("", "/nope.pem", pki.key),
    }
    for message, (ca, cert, key) in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            client_context(ca, cert, key)


@pytest.mark.parametrize(
    ("name", "module", "config_type", "env_prefix"),
    [
        ("node-agent.service", node_agent, AgentConfig, ENV_PREFIX),
        ("fleetctl-aggregator.service", fleetctl, AggregatorConfig, AGGREGATOR_ENV_PREFIX),
    ],
)
def test_units_load_tls_files_as_credentials(
    name: str,
    module: object,
    config_type: type[AgentConfig] | type[AggregatorConfig],
    env_prefix: str,
    pki: Pki,
    tmp_path: Path,
) -> None:
    """Each unit loads ca, cert and key with LoadCredential= from /etc/<service>/tls and
    passes the credentials directory's copies (%d) as flags; with %d made a directory of
    real files, the unit's command line yields a working TLS context."""
    text = (DEPLOY / "systemd" / name).read_text()
    credentials = dict(
        line.removeprefix("LoadCredential=").split(":", 1)
        for line in text.splitlines()
        if line.startswith("LoadCredential=")
    )
    assert set(credentials) == {"tls-ca", "tls-cert", "tls-key"}
    assert all(re.fullmatch(r"/etc/[a-z-]+/tls/[a-z]+\.pem", path) for path in credentials.values())
    for credential, source in zip(
        ("tls-ca", "tls-cert", "tls-key"), (pki.ca, pki.cert, pki.key), strict=True
    ):
        (tmp_path / credential).write_bytes(Path(source).read_bytes())
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    args = shlex.split(exec_start.replace("%d", str(tmp_path)))[1:]
    parsed = module.parser().parse_args(args)  # type: ignore[attr-defined]
    parsed.config = None  # /etc/... is not on the test machine
    settings = settings_from(parsed, config_type, env_prefix)
    assert settings.tls_ca == str(tmp_path / "tls-ca")
    assert client_context(settings.tls_ca, settings.tls_cert, settings.tls_key) is not None

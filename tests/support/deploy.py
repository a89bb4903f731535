"""The repo's nats-server configs rendered for a test: loopback ports, a tmp store and test
keys in place of the deployment's, each replaced string required to be present (so a config
that drifts fails its test instead of silently running something else)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats"
STORE = "/var/lib/nats/jetstream"
AUTH_NODE = "node-1"
AUTH_CLUSTER = "gpu-a"
"""The node and cluster of auth.conf's template entry, the one an operator copies."""
AUTH_JS_API_PREFIX = "JS.FLEET.API"
"""Where auth.conf's nodes reach the fleet's JetStream API."""
AUTH_ENTRY_BEGIN = f"# BEGIN {AUTH_NODE}\n"
AUTH_ENTRY_END = f"# END {AUTH_NODE}\n"


def replace_all(name: str, text: str, replacements: Mapping[str, str]) -> str:
    for old, new in replacements.items():
        assert old in text, f"{name} no longer contains {old!r}"
        text = text.replace(old, new)
    return text


def render(name: str, target: Path, replacements: Mapping[str, str]) -> Path:
    """The repo's ``deploy/nats/<name>`` with each replacement applied, written to ``target``."""
    text = replace_all(name, (DEPLOY / name).read_text(), replacements)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def render_auth(
    target: Path, port: int, store: Path, aggregator: str, nodes: Mapping[str, tuple[str, str]]
) -> Path:
    """auth.conf on ``port`` with ``store``, the aggregator's public key, and one user per
    entry of ``nodes`` (node id: (cluster, public key)), each made from node-1's entry the
    way its comments tell an operator to."""
    name = "auth.conf"
    text = replace_all(
        name,
        (DEPLOY / name).read_text(),
        {
            "0.0.0.0:4222": f"127.0.0.1:{port}",
            STORE: str(store),
            "AGGREGATOR_PUBLIC_KEY": aggregator,
        },
    )
    head, rest = text.split(AUTH_ENTRY_BEGIN)
    entry, tail = rest.split(AUTH_ENTRY_END)
    entries = [
        replace_all(
            name,
            entry,
            {"NODE_1_PUBLIC_KEY": key, AUTH_CLUSTER: cluster, AUTH_NODE: node},
        )
        for node, (cluster, key) in nodes.items()
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(head + "".join(entries) + tail)
    return target


def fleet_auth(
    directory: Path,
    nodes: Mapping[str, tuple[str, str]],
    aggregator: str,
    *flags: str,
) -> Path:
    """``fleet-auth.conf`` in ``directory`` (where the deploy configs include it from), as
    ``fleetctl nats-config --nodes`` writes it for ``nodes`` (node id: (cluster, public
    key)) and the aggregator's key; ``flags`` go to the command as they are."""
    listing = directory / "nodes.txt"
    directory.mkdir(parents=True, exist_ok=True)
    listing.write_text("".join(f"{n} {c} {k}\n" for n, (c, k) in nodes.items()))
    target = directory / "fleet-auth.conf"
    argv = [FLEETCTL, "nats-config", "--nodes", str(listing), "--aggregator", aggregator]
    subprocess.run([*argv, *flags, "--output", str(target)], check=True, capture_output=True)
    return target

"""The entry point of the single-file artifact (``python -m deploy.build`` makes it): its
first argument names the program, and the rest are that program's arguments::

    nats-node-agent.pyz node-agent start --config /etc/node-agent/agent.toml
    nats-node-agent.pyz fleetctl nodes
    nats-node-agent.pyz install --role node --start     # deploy/install/install.sh

Only the standard library is imported before the program is chosen, so a file run by
another Python than the one it was built for (its compiled modules do not load) says so
in one line instead of a traceback.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "nats_node_agent_deploy"
"""The deploy files the build puts beside the packages (absent outside the artifact)."""

USAGE = """\
usage: nats-node-agent.pyz {node-agent,fleetctl,install} [ARGS...]

node-agent and fleetctl in one file (built by `python -m deploy.build`):
  node-agent ARGS   the node agent (node-agent --help)
  fleetctl ARGS     the operator's and the aggregator's command line (fleetctl --help)
  install ARGS      install this file and the systemd units (install --help)
"""


def program(name: str) -> Callable[[list[str]], int]:
    """The ``main`` of node-agent or fleetctl (imported only now: it loads compiled modules)."""
    if name == "node-agent":
        from actors.cli.node_agent import main as node_agent

        return node_agent
    from actors.cli.fleetctl.main import main as fleetctl

    return fleetctl


def cannot_load(exc: ImportError, deploy: Path = DEPLOY) -> str:
    """Why the programs cannot start here, in one line: the artifact's compiled modules are
    for the Python and platform it was built on."""
    try:
        built = (deploy / "built-for").read_text().strip()
    except OSError:
        built = "another Python"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    here = f"CPython {version} on {sysconfig.get_platform()}"
    return f"cannot load this file's compiled modules ({exc}): built for {built}, this is {here}"


def install(args: list[str], deploy: Path = DEPLOY) -> int:
    """Run install.sh with this file as the artifact (replaces this process)."""
    script = deploy / "install" / "install.sh"
    if not script.is_file():
        sys.stderr.write("error: install: only the single-file artifact carries install.sh\n")
        return 2
    artifact = str(Path(sys.argv[0]).resolve())
    os.execv("/bin/sh", ["/bin/sh", str(script), "--artifact", artifact, *args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    name, args = argv[0], argv[1:]
    if name == "install":
        return install(args)
    if name not in ("node-agent", "fleetctl"):
        sys.stderr.write(USAGE + f"error: unknown program {name!r}\n")
        return 2
    try:
        entry = program(name)
    except ImportError as exc:
        sys.stderr.write(f"error: {cannot_load(exc)}\n")
        return 1
    return entry(args)

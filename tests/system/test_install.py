"""deploy/install: install.sh, run by the artifact's ``install`` as root in a temporary root
where systemd is not running (users added to its etc/passwd, units enabled with
``systemctl --root``), checked file by file: users, owners, modes, the enabled units, and
the extracted packages a service user runs but cannot change. Then the recipes that use
it: the cloud-init file (``cloud-init schema``; its files and its install line run in a
temporary root) and the SkyPilot task, with shellcheck on every shell script."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.node.config import ENV_PREFIX, AgentConfig
from actors.runtime.config import build, read_keys
from schemas.signing import load_key_file
from tests.support.artifact import Fresh

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "deploy" / "install"
UNITS = ROOT / "deploy" / "nats" / "systemd"
OPT = "opt/nats-node-agent"
SBIN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture
def target() -> Iterator[Path]:
    """An empty root, mode 0755 as / is (pytest's own temporary folders are root's alone),
    with the users and groups of a fresh Debian that install.sh meets."""
    if os.geteuid() != 0:
        pytest.skip("install.sh makes users and root-owned files: it runs as root")
    with tempfile.TemporaryDirectory(prefix="nna-install-") as temporary:
        root = Path(temporary)
        root.chmod(0o755)
        (root / "etc").mkdir()
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
        (root / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\n")
        yield root


def install(fresh: Fresh, *args: str) -> subprocess.CompletedProcess[str]:
    """``nats-node-agent.pyz install ARGS``, as root with sbin on PATH (useradd)."""
    return subprocess.run(
        fresh.argv("install", *args),
        env=fresh.env | {"PATH": SBIN_PATH},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def ids(root: Path, table: str) -> dict[str, int]:
    """Names to ids in the target's own etc/passwd or etc/group."""
    lines = (root / "etc" / table).read_text().splitlines()
    return {line.split(":")[0]: int(line.split(":")[2]) for line in lines}


def owned(root: Path, path: str) -> tuple[str, str, str]:
    """(mode, user, group) of a target path, named by the target's own tables."""
    found = (root / path).lstat()
    users = {number: name for name, number in ids(root, "passwd").items()}
    groups = {number: name for name, number in ids(root, "group").items()}
    return oct(stat.S_IMODE(found.st_mode)), users[found.st_uid], groups[found.st_gid]


EXPECTED = {
    OPT: ("0o755", "root", "root"),
    f"{OPT}/nats-node-agent.pyz": ("0o755", "root", "root"),
    f"{OPT}/bin/node-agent": ("0o755", "root", "root"),
    f"{OPT}/bin/fleetctl": ("0o755", "root", "root"),
    f"{OPT}/site": ("0o755", "root", "root"),
    "etc/node-agent": ("0o750", "root", "node-agent"),
    "etc/node-agent/agent.toml": ("0o640", "root", "node-agent"),
    "etc/node-agent/operators": ("0o644", "root", "root"),
    "etc/node-agent/tls": ("0o700", "root", "root"),
    "var/lib/node-agent": ("0o700", "node-agent", "node-agent"),
    "var/lib/node-agent/node.nk": ("0o600", "node-agent", "node-agent"),
    "etc/fleetctl": ("0o755", "root", "root"),
    "etc/fleetctl/aggregator.toml": ("0o644", "root", "root"),
    "etc/fleetctl/tls": ("0o700", "root", "root"),
    "usr/local/bin/nats-server": ("0o755", "root", "root"),
    "etc/nats": ("0o750", "root", "nats"),
}
"""Every path install.sh makes for the three roles, with its mode and owner."""


@pytest.mark.slow
def test_install_makes_the_users_files_and_modes_of_every_role(fresh: Fresh, target: Path) -> None:
    """Users node-agent and nats (system, no login), every path with its mode and owner,
    the units copied and enabled, the node's key made (its public key printed), and the
    program the units start present."""
    done = install(fresh, "--root", str(target), "--role", "node", "--role", "aggregator",
                   "--role", "nats-server")  # fmt: skip
    assert done.returncode == 0, done.stderr
    for path, expected in EXPECTED.items():
        assert owned(target, path) == expected, path
    users = {line.split(":")[0]: line.split(":") for line in
             (target / "etc" / "passwd").read_text().splitlines()}  # fmt: skip
    for user, home in (("node-agent", "/var/lib/node-agent"), ("nats", "/var/lib/nats")):
        assert int(users[user][2]) < 1000 and users[user][5:] == [home, "/usr/sbin/nologin"]
        assert user in ids(target, "group")
    key = load_key_file(target / "var/lib/node-agent/node.nk")
    assert key.public_key in done.stdout
    assert (target / OPT / "nats-node-agent.pyz").read_bytes() == fresh.artifact.read_bytes()
    example = ROOT / "deploy" / "nats" / "agent.example.toml"
    assert (target / "etc/node-agent/agent.toml").read_text() == example.read_text()
    wants = target / "etc/systemd/system/multi-user.target.wants"
    for unit in ("node-agent.service", "fleetctl-aggregator.service", "nats-server.service"):
        assert owned(target, f"etc/systemd/system/{unit}") == ("0o644", "root", "root")
        assert (target / "etc/systemd/system" / unit).read_text() == (UNITS / unit).read_text()
        assert os.readlink(wants / unit) == f"/etc/systemd/system/{unit}"
        started = re.search(r"^ExecStart=(\S+)", (UNITS / unit).read_text(), re.M)
        assert started is not None and (target / started.group(1).lstrip("/")).is_file()


@pytest.mark.slow
def test_a_service_user_runs_the_extracted_packages_but_cannot_change_them(
    fresh: Fresh, target: Path
) -> None:
    """The packages are extracted at install time, owned by root and writable by no one
    else; nobody (uid 65534) runs node-agent from them, and nothing is written there."""
    assert install(fresh, "--root", str(target)).returncode == 0
    site = target / OPT / "site"
    before = sorted(site.rglob("*"))
    assert any(path.name.endswith(".pyc") for path in before), "compiled at install time"
    for path in before:
        found = path.lstat()
        assert found.st_uid == 0 and not found.st_mode & 0o022, path
    wrapper = (target / OPT / "bin" / "node-agent").read_text()
    assert "export SHIV_ROOT=/opt/nats-node-agent/site\n" in wrapper
    assert 'exec /opt/nats-node-agent/nats-node-agent.pyz node-agent "$@"\n' in wrapper
    run = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         str(target / OPT / "nats-node-agent.pyz"), "node-agent", "--version"],
        env={"PATH": "/usr/bin:/bin", "SHIV_ROOT": str(site), "HOME": "/nonexistent"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.startswith("node-agent "), run.stderr
    assert sorted(site.rglob("*")) == before


@pytest.mark.slow
def test_install_again_keeps_configs_and_key_and_drops_earlier_builds(
    fresh: Fresh, target: Path
) -> None:
    """A second install (an upgrade) keeps the config's text but puts its mode back, keeps
    the node's key, and removes the packages of earlier builds."""
    assert install(fresh, "--root", str(target)).returncode == 0
    config = target / "etc/node-agent/agent.toml"
    config.write_text('cluster = "mine"\n')
    config.chmod(0o666)
    key = (target / "var/lib/node-agent/node.nk").read_bytes()
    site = target / OPT / "site"
    (current,) = site.iterdir()
    earlier = site / "nats-node-agent.pyz_0000"
    (earlier / "site-packages").mkdir(parents=True)
    again = install(fresh, "--root", str(target))
    assert again.returncode == 0, again.stderr
    assert config.read_text() == 'cluster = "mine"\n'
    assert owned(target, "etc/node-agent/agent.toml") == ("0o640", "root", "node-agent")
    assert (target / "var/lib/node-agent/node.nk").read_bytes() == key
    assert "seed written" not in again.stderr
    assert list(site.iterdir()) == [current]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--role", "web"], "--role: one of node, aggregator, nats-server"),
        (["--start"], "--start with --root: nothing runs in another root"),
        (["--root", "/nonexistent/root"], "--root /nonexistent/root: no such directory"),
    ],
)
def test_install_refuses_what_it_cannot_do_in_one_line(
    fresh: Fresh, target: Path, args: list[str], error: str
) -> None:
    """A wrong role, --start into another root, a missing root: exit 1, one line, and
    nothing installed."""
    where = [] if "--root" in args else ["--root", str(target)]
    done = install(fresh, *where, *args)
    assert (done.returncode, done.stderr) == (1, f"install: error: {error}\n")
    assert not (target / "opt").exists()


def shellcheck(script: str, shell: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["shellcheck", "--shell", shell, "-"],
        input=script, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def needs(program: str) -> None:
    if shutil.which(program) is None:
        pytest.skip(f"{program} is not installed (Debian's {program} package; .ci/run adds it)")


def test_install_sh_passes_shellcheck() -> None:
    """install.sh is POSIX sh that shellcheck finds nothing in."""
    needs("shellcheck")
    checked = shellcheck((INSTALL / "install.sh").read_text(), "sh")
    assert checked.returncode == 0, checked.stdout


def cloud_config() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((INSTALL / "cloud-init.yaml").read_text())
    return loaded


def test_the_cloud_init_file_is_valid_cloud_config() -> None:
    """cloud-init's own schema check accepts it, and its script passes shellcheck."""
    needs("cloud-init")
    checked = subprocess.run(
        ["cloud-init", "schema", "--config-file", str(INSTALL / "cloud-init.yaml")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert checked.returncode == 0 and "Valid cloud-config" in checked.stdout, checked.stderr
    needs("shellcheck")
    (script,) = cloud_config()["runcmd"]
    linted = shellcheck(script, "sh")
    assert linted.returncode == 0, linted.stdout


def install_line(script: str) -> list[str]:
    """The words of a recipe's ``... .pyz install ...`` line."""
    (line,) = [line for line in script.splitlines() if ".pyz install " in line]
    return shlex.split(line)


@pytest.mark.slow
def test_cloud_init_files_then_its_install_line_make_a_node(fresh: Fresh, target: Path) -> None:
    """As at first boot: cloud-init's files written as root with their modes, then its
    install line (into the temporary root, not started): the config and the TLS files are
    kept with their modes set for the service, and the config loads with the real loader.
    Its download names the file this checkout builds, and its checksum is checked before
    anything runs."""
    config = cloud_config()
    for entry in config["write_files"]:
        path = target / entry["path"].lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(entry["content"])
        path.chmod(int(entry["permissions"], 8))
    (script,) = config["runcmd"]
    assert f"/{fresh.artifact.name}\n" in script
    assert script.startswith("set -eu\n"), "a failed download or checksum stops the script"
    assert script.index("| sha256sum -c -") < script.index(".pyz install ")
    words = install_line(script)
    assert words[:3] == ["python3", "/run/nats-node-agent.pyz", "install"]
    assert words[-1] == "--start"
    done = install(fresh, *words[3:-1], "--root", str(target))
    assert done.returncode == 0, done.stderr
    written = {entry["path"]: entry["content"] for entry in config["write_files"]}
    for path, expected in (
        ("etc/node-agent/agent.toml", ("0o640", "root", "node-agent")),
        ("etc/node-agent/operators", ("0o644", "root", "root")),
        ("etc/node-agent/tls/ca.pem", ("0o644", "root", "root")),
        ("etc/node-agent/tls/key.pem", ("0o600", "root", "root")),
    ):
        assert owned(target, path) == expected, path
        assert (target / path).read_text() == written["/" + path]
    agent = build(AgentConfig, ENV_PREFIX, file=target / "etc/node-agent/agent.toml", env={})
    assert agent.cluster == "gpu-a" and agent.js_api_prefix == "JS.FLEET.API"
    assert read_keys([], str(target / "etc/node-agent/operators")) == {"UCHANGEME"}


def test_the_skypilot_task_uploads_the_artifact_and_installs_it(artifact: Path) -> None:
    """The task has the keys SkyPilot needs to place it (resources with accelerators,
    nodes, setup, run); it uploads the file this checkout builds to the path its setup
    installs from; every variable setup reads is one of its envs; both scripts pass
    `bash -n`, and shellcheck where it is installed."""
    task: dict[str, Any] = yaml.safe_load((INSTALL / "skypilot.yaml").read_text())
    assert {"name", "num_nodes", "resources", "envs", "file_mounts", "setup", "run"} <= set(task)
    assert re.fullmatch(r"[A-Z0-9]+:\d+", task["resources"]["accelerators"])
    mounted = {source: where for where, source in task["file_mounts"].items()}
    words = install_line(task["setup"])
    assert words[:5] == ["sudo", "python3.11", mounted[f"dist/{artifact.name}"], "install",
                         "--role"]  # fmt: skip
    assert set(re.findall(r"\$(FLEET_\w+)", task["setup"])) <= set(task["envs"])
    for name in ("setup", "run"):
        parsed = subprocess.run(
            ["bash", "-n"], input=task[name], capture_output=True, text=True, timeout=30
        )
        assert parsed.returncode == 0, parsed.stderr
        if shutil.which("shellcheck"):
            linted = shellcheck(task[name], "bash")
            assert linted.returncode == 0, linted.stdout
